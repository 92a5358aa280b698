"""Adding and removing an engine as docs/engines.md documents it: one `serve deploy` of a multi-application
config with an engine application more (or one fewer), on a Ray cluster made with `ray start`. Serve
deploys only what changed: the mmserve application and the other engine keep their processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.e2e.fault_support import wait_for
from tests.e2e.ray_start_pool_scenario import stop_cluster
from tests.support.vllm_engines import free_tcp_port

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
BUILTIN = "mmserve-builtin"
PREFIX = "mmserve-engine-"


def _config(http_port: int, engines: list[str]) -> dict:
    """The multi-application config of docs/engines.md: the mmserve application and one application per engine."""
    apps = [{"name": "mmserve", "route_prefix": "/", "import_path": "serve_app:build_app",
             "args": {"engines": [], "engine_applications": PREFIX, "served_model_name": BUILTIN}}]
    apps += [{"name": PREFIX + engine, "route_prefix": None, "import_path": "serve_app:build_engine_app",
              "args": {"builtin_engine": {"step_interval_ms": 2.0}}} for engine in engines]
    return {"http_options": {"host": "127.0.0.1", "port": http_port}, "applications": apps}


def _replica_pids(dashboard: str) -> dict[str, list[int]]:
    """Serve's REST API: application → the pids of its replicas."""
    details = httpx.get(f"{dashboard}/api/serve/applications/", timeout=30).json()
    return {name: sorted(r["pid"] for d in app["deployments"].values() for r in d["replicas"] if r.get("pid"))
            for name, app in details["applications"].items()}


def test_serve_deploy_adds_and_removes_an_engine_application_and_restarts_nothing_else(tmp_path):
    workdir = Path(tempfile.mkdtemp(prefix="mmea", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_SERVE_ENABLE_HA_PROXY": "1",
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    port, dashboard_port, http_port = free_tcp_port(), free_tcp_port(), free_tcp_port()
    dashboard, base_url = f"http://127.0.0.1:{dashboard_port}", f"http://127.0.0.1:{http_port}"

    def run(*argv: str) -> None:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"

    def deploy(engines: list[str]) -> None:
        path = tmp_path / f"serve-{'-'.join(engines)}.json"
        path.write_text(json.dumps(_config(http_port, engines)))
        run(str(BIN / "serve"), "deploy", "-a", dashboard, str(path))

    def listed() -> dict[str, str]:
        try:
            return {e["engine"]: e["state"] for e in httpx.get(base_url + "/health", timeout=10).json()["engines"]}
        except httpx.HTTPError:
            return {}

    def chats(n: int) -> list[int]:
        body = {"model": BUILTIN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        return [httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).status_code for _ in range(n)]

    try:
        run(str(BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={workdir / 'ray'}",
            f"--dashboard-port={dashboard_port}", "--disable-usage-stats")
        deploy(["a"])
        wait_for(lambda: listed() == {PREFIX + "a": "ready"}, 300, "the service with engine a")
        assert chats(3) == [200] * 3
        before = _replica_pids(dashboard)

        deploy(["a", "b"])  # an engine more: one application more in the config
        wait_for(lambda: listed() == {PREFIX + "a": "ready", PREFIX + "b": "ready"}, 120, "engine b routed to")
        assert chats(6) == [200] * 6
        after_add = _replica_pids(dashboard)
        assert after_add["mmserve"] == before["mmserve"] and after_add[PREFIX + "a"] == before[PREFIX + "a"], (before, after_add)

        deploy(["b"])  # engine a removed: its application left out of the config
        wait_for(lambda: listed() == {PREFIX + "b": "ready"}, 120, "engine a drained and gone")
        wait_for(lambda: PREFIX + "a" not in _replica_pids(dashboard), 60, "engine a's application deleted")
        assert chats(3) == [200] * 3
        after_remove = _replica_pids(dashboard)
        assert after_remove["mmserve"] == before["mmserve"] and after_remove[PREFIX + "b"] == after_add[PREFIX + "b"], (after_add, after_remove)
    finally:
        stop_cluster(workdir / "ray")
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
