"""The pixels across nodes, run by `test_cross_node_pixels.py` in a process of its own: a Ray cluster made
with `ray start` on this machine, a head with the front end's resource (the ingress and the preprocessor
run there, `cluster/`'s way) and an engine node with the engine's (the app launches one real `vllm serve
--headless` CPU engine there, its engine client beside it), deployed with `serve deploy`; image chats
against it and against `vllm serve` on the same model with the same engine flags, one after the other.

Prints one JSON line: both sides' token ids per chat, where the preprocessor and the engine client ran,
the object store each of them maps, the engine node's store counters before and after the chats, and
what the engine client's socket sent the pixels from. Usage: cross_node_scenario.py MODEL_DIR VLLM_PYTHON WORKDIR
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.e2e.ray_start_pool_scenario import stop_cluster  # noqa: E402
from tests.support.images import image_uri  # noqa: E402
from tests.support.vllm_engines import VllmApiServer, free_tcp_port  # noqa: E402
from tests.support.vllm_reference import VLLM_CPU_ENV, WORKER_IN_ENGINE_CORE  # noqa: E402

MODEL = "tiny"
BIN = Path(sys.executable).parent
FRONT_END, ENGINE = "mmserve_front_end", "mmserve_engine"
# Distinct images (sizes that need a resize, and one that does not), one chat with two.
CHATS = [[(640, 480, 1)], [(333, 250, 2)], [(224, 168, 3), (500, 375, 4)]]


def _run(*argv: str, env: dict, timeout_s: float = 300) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def _messages(images: list[tuple[int, int, int]]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": image_uri(w, h, seed=s, fmt="JPEG")}} for w, h, s in images]
    return [{"role": "user", "content": [{"type": "text", "text": "Describe the picture."}, *parts]}]


def _chat(base_url: str, images: list[tuple[int, int, int]]) -> list[int]:
    body = {"model": MODEL, "messages": _messages(images), "max_tokens": 12, "temperature": 0.0, "return_token_ids": True}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


# What the driver reads from inside the cluster (a short-lived process of its own, attached to the head).
PROBE = """
import json, sys, ray
from ray import serve
from ray._private.internal_api import node_stats
ray.init(address=sys.argv[1], log_to_driver=False)
engine_node = sys.argv[2]
def plasma_file(pid):
    for line in open(f"/proc/{pid}/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "/dev/shm/plasma" in fields[5]:
            return fields[5].split(" ")[0].strip()
    return None
nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
stats = node_stats(nodes[engine_node]["NodeManagerAddress"], nodes[engine_node]["NodeManagerPort"]).store_stats
out = {"engine_node_created_bytes": stats.cumulative_created_bytes}
if sys.argv[3] == "all":
    client = serve.get_deployment_handle("EngineClient0", app_name="mmserve")
    preprocessor = serve.get_deployment_handle("Preprocessor", app_name="mmserve")
    client_pid, preprocessor_pid = client.pid.remote().result(timeout_s=60), preprocessor.pid.remote().result(timeout_s=60)
    status = client.launcher_status.remote().result(timeout_s=60)
    actors = ray._private.state.actors().values()
    out.update({
        "engine_client_node": status["engine_client_node_id"],
        "preprocessor_nodes": [a["Address"]["NodeID"] for a in actors if a["State"] == "ALIVE" and a["ActorClassName"].endswith(":Preprocessor")],
        "engine_client_plasma": plasma_file(client_pid), "preprocessor_plasma": plasma_file(preprocessor_pid),
        "frames": [[t.nbytes, t.mapping.split(" ")[0], t.array_address == t.frame_address]
                   for t in client.frame_traces.remote().result(timeout_s=60)],
    })
print(json.dumps(out))
"""


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: still stop the cluster (finally)
    model_dir, vllm_python, workdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_SERVE_ENABLE_HA_PROXY": "1",
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    http_port, port, dashboard = free_tcp_port(), free_tcp_port(), free_tcp_port()
    address, base_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
    reference = VllmApiServer(model_dir, served_model_name=MODEL, max_model_len=1024, log_path=workdir / "reference.log")
    try:
        ray = str(BIN / "ray")
        _run(ray, "start", "--head", f"--port={port}", "--num-cpus=2", f"--resources={json.dumps({FRONT_END: 100})}",
             f"--temp-dir={workdir / 'ray'}", f"--dashboard-port={dashboard}", "--disable-usage-stats", env=env)
        _run(ray, "start", f"--address={address}", "--num-cpus=2", f"--resources={json.dumps({ENGINE: 1})}",
             f"--dashboard-agent-listen-port={free_tcp_port()}", f"--metrics-export-port={free_tcp_port()}",
             f"--runtime-env-agent-port={free_tcp_port()}", env=env)
        nodes = json.loads(_run(sys.executable, "-c", (
            "import json, ray; ray.init(address=%r, log_to_driver=False); "
            "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}))") % address, env=env).strip().splitlines()[-1])
        [engine_node] = [node for node, resources in nodes.items() if ENGINE in resources]
        config = {
            "proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": [{
                "name": "mmserve", "route_prefix": "/", "import_path": "serve_app:build_app",
                "runtime_env": {"env_vars": {"PYTHONPATH": str(REPO)}},
                "args": {
                    "model": model_dir, "served_model_name": MODEL, "handshake_timeout_s": 600, "health_check_timeout_s": 60,
                    "trace_wire_frames": 32,
                    "engine_launch": {
                        "engine_args": {"max-model-len": 1024, "enforce-eager": True, "dtype": "bfloat16", "seed": 0},
                        "resources": {"CPU": 1, ENGINE: 1}, "env": {**VLLM_CPU_ENV, **WORKER_IN_ENGINE_CORE},
                        "vllm_command": [vllm_python, "-m", "vllm.entrypoints.cli.main"],
                    },
                    "ingress_resources": {FRONT_END: 0.001},
                    "preprocessor": {"min_replicas": 1, "max_replicas": 1, "resources": {FRONT_END: 0.001}},
                },
            }],
        }
        (workdir / "serve.json").write_text(json.dumps(config))
        _run(str(BIN / "serve"), "deploy", "-a", f"http://127.0.0.1:{dashboard}", str(workdir / "serve.json"), env=env)
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the app was not healthy within 600 s")
            time.sleep(1.0)
        before = json.loads(_run(sys.executable, "-c", PROBE, address, engine_node, "stats", env=env).strip().splitlines()[-1])
        mmserve = [_chat(base_url, images) for images in CHATS]
        after = json.loads(_run(sys.executable, "-c", PROBE, address, engine_node, "all", env=env).strip().splitlines()[-1])
        _run(str(BIN / "serve"), "shutdown", "-a", f"http://127.0.0.1:{dashboard}", "-y", env=env)
        stop_cluster(workdir / "ray")
        reference.start().wait_healthy(600)  # (after the cluster: the machine's two cores to one of them at a time)
        vllm = [_chat(reference.base_url, images) for images in CHATS]
        print(json.dumps({
            "mmserve": mmserve, "vllm_serve": vllm, "engine_node": engine_node,
            "engine_node_created_bytes": [before["engine_node_created_bytes"], after["engine_node_created_bytes"]],
            **{key: after[key] for key in ("engine_client_node", "preprocessor_nodes", "engine_client_plasma", "preprocessor_plasma", "frames")},
        }), flush=True)
    finally:
        if reference._proc is not None:
            reference.stop()
        stop_cluster(workdir / "ray")


if __name__ == "__main__":
    main()
