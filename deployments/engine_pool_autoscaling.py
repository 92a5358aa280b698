"""The engine pool's autoscaling policy: engines for the requests the engines hold and the KV cache they fill.

Serve's default policy counts a replica's ongoing calls, which for an engine client says nothing of
its engine's load: `add` answers as soon as the request is with the engine, and each ingress
replica's `subscribe` call stays open for as long as the replica lives. What saturates an engine is
the requests it holds (running or queued in its scheduler) and, for long contexts, its KV cache:
a few long requests can fill it while their count looks small. Each replica reports both
(`EngineClientDeployment.record_autoscaling_stats`; the KV-cache usage from the engine's scheduler
stats, 0–1). The pool wants enough engines for either: `requests held / target_ongoing_requests`,
and `summed KV-cache usage / target_kv_cache_usage`. Serve rounds up and applies min/max and the
up/down delays around this policy, and pickles this module by value into its controller, so it
imports nothing of this repository.
"""

from __future__ import annotations

from typing import Any

# The metrics each pool replica reports: requests its engine holds (running or waiting), and the
# fraction of its KV cache in use (absent until the engine has reported scheduler stats).
ENGINE_REQUESTS_METRIC = "engine_requests"
ENGINE_KV_CACHE_USAGE_METRIC = "engine_kv_cache_usage"


class EngineSaturationPolicy:
    """Serve autoscaling policy (called with `ray.serve.config.AutoscalingContext`); Serve makes one
    per pool with `policy_kwargs`. `target_kv_cache_usage` None: requests held only."""

    def __init__(self, target_kv_cache_usage: float | None = None) -> None:
        self.target_kv_cache_usage = target_kv_cache_usage

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        """The engines the pool's load needs; the current number while no replica has reported."""
        metrics = ctx.aggregated_metrics or {}
        held = metrics.get(ENGINE_REQUESTS_METRIC) or {}
        if not held:
            return ctx.current_num_replicas, {}
        wanted = sum(held.values()) / ctx.config.get_target_ongoing_requests()
        kv_usage = metrics.get(ENGINE_KV_CACHE_USAGE_METRIC) or {}
        if self.target_kv_cache_usage and kv_usage:
            wanted = max(wanted, sum(kv_usage.values()) / self.target_kv_cache_usage)
        return wanted, {}
