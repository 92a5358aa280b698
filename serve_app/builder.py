"""Application builder: `serve run serve_app:build_app key=value ...` or `serve_app:app`.

Builds one engine-client deployment per engine (each a single replica: it owns that
engine's sockets), or with `engine_pool` one engine-client deployment that Serve scales (a
replica per engine), the preprocessor for vision models, and the ingress, which holds their
handles; each gets its own plain settings (`settings.py`), never the whole `AppConfig`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray.serve import Application

from .config import AppConfig


# Ray's setting that puts HAProxy, not Serve's Python proxy, in front of the ingress replicas.
HA_PROXY_FLAG = "RAY_SERVE_ENABLE_HA_PROXY"

# A placement bundle cannot be empty: the engine client reserves a sliver of a CPU.
ENGINE_CLIENT_CPUS = 0.01

# How long a deleted engine application may take to finish the streams it serves before Serve stops it.
ENGINE_APPLICATION_DRAIN_TIMEOUT_S = 600.0


def _engine_client_placement(config: AppConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """An engine client's Ray actor options and placement group options."""
    from deployments.replica_env import PIXEL_REPLICA_ENV

    runtime_env = {"env_vars": dict(PIXEL_REPLICA_ENV)}  # it holds references to pixels
    if config.engine_launch is None:
        return {"num_cpus": 0, "resources": dict(config.engine_client_resources), "runtime_env": runtime_env}, {}
    # Bundle 0: the engine client; bundle 1: its engine's launcher. STRICT_PACK puts both on one
    # node (placed by the engine's resources), so they talk over loopback.
    return {"num_cpus": ENGINE_CLIENT_CPUS, "runtime_env": runtime_env}, {
        "placement_group_bundles": [{"CPU": ENGINE_CLIENT_CPUS}, dict(config.engine_launch.resources)],
        "placement_group_strategy": "STRICT_PACK",
    }


def _guard_haproxy_ports() -> None:
    """With HAProxy: start the reaper that leaves no HAProxy behind this Serve however it is stopped
    (`leftovers.py`); and in the `serve run` process about to start Ray, refuse to start, in one line,
    while an HAProxy left by an earlier run holds a port it needs."""
    from . import leftovers

    if os.environ.get(HA_PROXY_FLAG) != "1" or (watched := leftovers.watched_process()) is None:
        return
    if watched == os.getpid() and (message := leftovers.leftover_message(wait_s=leftovers.START_UP_WAIT_S)) is not None:
        raise SystemExit(f"mmserve: {message}")
    if (failed := leftovers.start_reaper(watched)) is not None:
        logging.getLogger("ray.serve").warning("mmserve: no reaper for HAProxy left behind by an unclean stop: %s", failed)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Build the mmserve application from builder args (see `AppConfig`)."""
    # Imported here so that `import serve_app` stays light for tools and tests.
    from deployments.engine_client import EngineClientDeployment
    from deployments.ingress import Ingress, ingress_actor_options
    from deployments.preprocessor import PreprocessorDeployment
    from mmserve.multimodal import load_image_family
    from mmserve.vision import resize_path

    from .settings import engine_client_settings, engine_pool_scaling, preprocessor_scaling, preprocessor_settings, serving_settings

    config = AppConfig.model_validate(args or {})
    _guard_haproxy_ports()
    if os.environ.get(HA_PROXY_FLAG) != "1":
        # Said in the `serve run` process, whose output the user watches; Ray starts with it.
        logging.getLogger("ray.serve").warning(
            "%s is not set: Serve's Python proxy relays every request and SSE chunk, a large share of the "
            "gateway's CPU; start Ray with %s=1 (`cluster/ray.env`)", HA_PROXY_FLAG, HA_PROXY_FLAG,
        )
    actor_options, placement = _engine_client_placement(config)
    engines = []
    engine_pool = None
    if (pool_scaling := engine_pool_scaling(config)) is not None:
        # One deployment, one engine per replica (all alike: loopback addresses on random ports).
        engine_pool = EngineClientDeployment.options(
            name="EnginePool", ray_actor_options=actor_options, **placement, **pool_scaling.options()
        ).bind(engine_client_settings(config, config.engine_endpoints()[0]))
    else:
        engines = [
            EngineClientDeployment.options(name=f"EngineClient{i}", ray_actor_options=actor_options, **placement).bind(
                engine_client_settings(config, endpoint)
            )
            for i, endpoint in enumerate(config.engine_endpoints())
        ]
    preprocessor = None
    if load_image_family(config.model_dir) is not None:
        preprocessor = PreprocessorDeployment.options(**preprocessor_scaling(config).options()).bind(preprocessor_settings(config))
        # Said here, in the `serve run` process whose output the user watches (the replicas' own
        # start-up logs go to Ray's log files); the replicas run from the same environment.
        logging.getLogger("ray.serve").info("mmserve image resize path: %s", resize_path())
    return Ingress.options(
        num_replicas=config.ingress_replicas, max_queued_requests=config.limits.ingress_max_queued_requests,
        ray_actor_options=ingress_actor_options(config.ingress_resources),
    ).bind(serving_settings(config), engines, preprocessor, engine_pool, config.engine_applications)


def build_engine_app(args: dict[str, Any] | None = None) -> Application:
    """One engine as a Serve application of its own (`serve_app:build_engine_app`), for an mmserve
    application whose `engine_applications` prefix its name starts with: it routes to it while it is
    deployed and drains it when it is deleted, and adding or removing one restarts nothing else.
    The same arguments as `build_app` (the same model, limits and timeouts; one engine: `engines`
    with one endpoint, `engine_launch`, or the built-in engine); give it `route_prefix: null`."""
    from deployments.engine_client import EngineClientDeployment
    from deployments.router import ENGINE_APPLICATION_DEPLOYMENT

    from .settings import engine_client_settings

    config = AppConfig.model_validate(args or {})
    if config.engine_pool is not None or config.engine_applications is not None:
        raise ValueError("an engine application is one engine: engine_pool and engine_applications belong to the mmserve application")
    endpoints = config.engine_endpoints()
    if len(endpoints) != 1:
        raise ValueError(f"an engine application is one engine; got {len(endpoints)} (engines / engine_launch.count)")
    actor_options, placement = _engine_client_placement(config)
    return EngineClientDeployment.options(
        name=ENGINE_APPLICATION_DEPLOYMENT, ray_actor_options=actor_options, **placement,
        # Deleted, it stops once the ingress replicas' streams there have finished (their drain).
        graceful_shutdown_timeout_s=ENGINE_APPLICATION_DRAIN_TIMEOUT_S, graceful_shutdown_wait_loop_s=1.0,
    ).bind(engine_client_settings(config, endpoints[0]))
