"""The environment the application gives its own replicas (their `runtime_env`): the settings of the
replicas' processes are set here, so that whoever starts Ray gives only the Ray instance's
(`cluster/ray.env`)."""

from __future__ import annotations

from typing import Any

from .pixel_store import OBJECT_REF_ENV

# Every replica: Serve hands Ray its cached request metrics once a second (Serve's default: ten times),
# which Ray exports far less often anyway: less idle CPU in each replica and each handle.
REPLICA_ENV = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}
# The ingress: its code on the replica's own event loop, where its HTTP server (Serve's direct ingress)
# runs; with Serve's default, a second loop in a thread of its own, every request and every SSE chunk
# would cross between the two threads. Its blocking work runs in threads of its own (`off_loop`), so the
# shared loop does not delay Serve's health checks.
INGRESS_REPLICA_ENV = {**REPLICA_ENV, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
# The replicas that hold references to pixels (engine clients, preprocessor replicas).
PIXEL_REPLICA_ENV = {**REPLICA_ENV, **OBJECT_REF_ENV}


def runtime_env(env_vars: dict[str, str]) -> dict[str, Any]:
    return {"env_vars": dict(env_vars)}
