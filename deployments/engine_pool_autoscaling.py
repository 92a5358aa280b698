"""The engine pool's autoscaling policy: engines for the requests the engines hold.

Serve's default policy counts a replica's ongoing calls, which for an engine client says nothing of
its engine's load: `add` answers as soon as the request is with the engine, and each ingress
replica's `subscribe` call stays open for as long as the replica lives. What saturates an engine is
the requests it holds (running or queued in its scheduler), which each replica reports
(`EngineClientDeployment.record_autoscaling_stats`). The pool wants
`ceil(requests held / target_ongoing_requests)` engines; Serve applies min/max and the up/down
delays around this function, and pickles this module by value into its controller, so it imports
nothing of this repository.
"""

from __future__ import annotations

from typing import Any

# The metric each pool replica reports: requests its engine holds (running or waiting).
ENGINE_REQUESTS_METRIC = "engine_requests"


def engine_requests_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve autoscaling policy (`ctx`: `ray.serve.config.AutoscalingContext`): the engines the held
    requests need at the pool's target per engine; the current number while no replica has reported."""
    per_replica = (ctx.aggregated_metrics or {}).get(ENGINE_REQUESTS_METRIC) or {}
    if not per_replica:
        return ctx.current_num_replicas, {}
    held = sum(per_replica.values())
    return held / ctx.config.get_target_ongoing_requests(), {}
