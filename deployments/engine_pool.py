"""The engine pool: its routing, in Ray Serve's request-router API (every call names its engine), and its scaling.

An engine pool is one engine-client deployment whose replicas Serve scales, each owning the engine
it launched. The ingress chooses the engine itself (`mmserve.transit.router`: load, affinity,
drains), so the pool's request router does not choose: it delivers each call to the replica named
by the call's `engine` argument, and it tells the ingress which replicas there are (the same list
in every ingress replica: Serve's controller broadcasts it to every router).

This router runs in each caller's process (Serve builds one per deployment handle there), so the
replica list it publishes (`engine_pool_members.py`) is read in-process by `deployments/router.py`'s
`EnginePoolMembers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from .engine_pool_autoscaling import EngineSaturationPolicy
from .replica_router import NamedReplicaRouter


class EngineReplicaRouter(NamedReplicaRouter):
    """Delivers a call to the replica its `engine` argument names (`replica_router.py`); a call
    naming a replica that is gone reaches another, which takes it as not its own (a `subscribe` ends
    at once, an `info` is None): the ingress then treats that engine as gone."""

    ARGUMENT = "engine"


@dataclass(frozen=True)
class EnginePoolScaling:
    """How Serve scales an engine pool (`engine_pool.*` in the config)."""

    min_engines: int
    max_engines: int
    # Requests held per engine (running or queued in its scheduler) the pool scales to.
    target_requests_per_engine: float
    # KV-cache usage per engine (0-1) the pool scales to; None: requests held only.
    target_kv_cache_usage: float | None
    upscale_delay_s: float
    downscale_delay_s: float
    look_back_period_s: float
    # How long an engine being taken away may take to finish its streams before it is stopped.
    drain_timeout_s: float

    def options(self) -> dict[str, Any]:
        """`EngineClientDeployment.options(...)` for a pool scaled this way."""
        return {
            "num_replicas": "auto",
            "autoscaling_config": AutoscalingConfig(
                min_replicas=self.min_engines,
                max_replicas=self.max_engines,
                initial_replicas=self.min_engines,
                target_ongoing_requests=self.target_requests_per_engine,
                upscale_delay_s=self.upscale_delay_s,
                downscale_delay_s=self.downscale_delay_s,
                look_back_period_s=self.look_back_period_s,
                metrics_interval_s=min(1.0, self.look_back_period_s / 2),
                policy=AutoscalingPolicy(
                    policy_function=EngineSaturationPolicy,
                    policy_kwargs={"target_kv_cache_usage": self.target_kv_cache_usage},
                ),
            ),
            "request_router_config": RequestRouterConfig(request_router_class=EngineReplicaRouter),
            # Serve waits this long for a stopping replica's calls to end: the ingress replicas end
            # their output streams once their requests there have finished (their drain).
            "graceful_shutdown_timeout_s": self.drain_timeout_s,
            "graceful_shutdown_wait_loop_s": 1.0,
        }
