"""A Serve config that sets the Ingress's `ray_actor_options` drops the runtime_env the application
sets (`deployments/replica_env.py`): under a real `serve run`, the replica says so in its log, naming
each variable it runs without."""

from __future__ import annotations

import httpx
import pytest

from deployments.replica_env import INGRESS_REPLICA_ENV

from .serve_run_support import ServeRun

pytestmark = pytest.mark.serve


def test_an_ingress_whose_runtime_env_a_serve_config_replaced_says_so():
    overridden = [{"name": "Ingress", "ray_actor_options": {"num_cpus": 0.5}}]
    with ServeRun({"builtin_engine": {"step_interval_ms": 2.0}}, deployments=overridden) as run:
        ok = httpx.post(run.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200, ok.text
        logs = run.replica_logs("Ingress")
    [warning] = [line for line in logs.splitlines() if "this ingress replica runs without" in line] or [logs[-3000:]]
    assert all(f"{name}=" in warning for name in INGRESS_REPLICA_ENV), warning
