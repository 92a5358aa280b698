"""A Serve request router for callers that choose the replica themselves: each call names it.

The engine pool's callers (the ingress chooses an engine: `engine_pool.py`) and the preprocessor's
(an engine client attaches to each replica over the preprocessing link: `preprocessor_calls.py`)
need every replica by name and the list of them. This router delivers a call to the replica named
by its `ARGUMENT` keyword and publishes the replica list in the caller's process
(`engine_pool_members.py`; Serve's controller broadcasts it to every router).

A call naming a replica that is gone (stopped between the caller's choice and the call) goes to any
replica, which refuses it as not its own; a call naming none goes to any replica.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .engine_pool_members import publish_members


class NamedReplicaRouter(RequestRouter):
    # The keyword argument by which a call names its replica (its unique id).
    ARGUMENT = "replica"

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = tuple(sorted(replica.replica_id.unique_id for replica in replicas))
        publish_members(self._deployment_id.app_name, self._deployment_id.name, ids)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # Serve's routing loop retries a request whose chosen replica could not take it at once: with
        # no back-off it would spin on this process's event loop without ever yielding it.
        pending_request.routing_context.should_backoff = True
        target: Any = pending_request.kwargs.get(self.ARGUMENT)
        if target:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    return [[replica]]
        return [candidate_replicas]
