"""Colocation on a multi-node Ray cluster (two nodes on this machine, its own cluster in a child
process): engines launched by the application land, with their engine clients, on the node that has
the engines' resource, and the ingress and preprocessor replicas on the node that has the front end's
(`ingress_resources`, `preprocessor.resources`), never beside the engines though that node has CPUs to
spare; requests are served across both; nothing is left after the app is deleted.
The engines are the built-in engine behind a `vllm serve`-shaped command line (seconds, not minutes);
placement does not depend on what the engine process is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.vllm_engines import free_tcp_port

pytestmark = pytest.mark.serve

SCENARIO = Path(__file__).with_name("multinode_colocation_scenario.py")
REPO = Path(__file__).resolve().parents[2]


def test_launched_engines_and_their_clients_share_the_engine_node():
    # Its own Ray temp root: `Cluster` writes the machine's "current cluster" file (ray_current_cluster)
    # there, which any `serve run` started meanwhile (README's quick start, in the same pytest process's
    # background or in another) would otherwise join instead of starting its own Ray.
    ray_tmp = tempfile.mkdtemp(prefix="mmserve-ray-")  # short: Ray's socket paths live under it
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}", "RAY_AUTH_MODE": "disabled",
           "RAY_TMPDIR": ray_tmp}
    try:
        proc = subprocess.run([sys.executable, str(SCENARIO), str(free_tcp_port())], capture_output=True, text=True,
                              timeout=600, env=env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1])
    assert result["engine_node"] != result["head_node"]
    for placement in result["placements"]:
        assert placement == {"client": result["engine_node"], "engine": result["engine_node"]}, result
    assert result["answers"] == [200] * 8, result
    assert all(n >= 1 for n in result["requests_per_engine"]), result  # served across both engines
    assert all(result["engine_pids"]) and result["left_after_delete"] == [], result
    assert [name for name, _ in result["front_end_nodes"]] == ["Ingress", "Ingress", "Preprocessor", "Preprocessor"], result
    assert {node for _, node in result["front_end_nodes"]} == {result["head_node"]}, result
