"""Run by tests/e2e/test_multinode_colocation.py in its own process (its own Ray cluster, apart from
the test session's): a two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`) — a head
with the front end's custom resource and an "engine" node told apart by the engines' — and the
application launching two engines that need theirs, its two ingress and two preprocessor replicas
asking for the front end's (`cluster/serve_launch.yaml`'s way). Prints one JSON line with where
everything ran."""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

from serve_app import build_app
from serve_app.config import BUILTIN_MODEL_DIR

# The custom resource `cluster/` gives the front end's nodes (the head and CPU workers) only.
FRONT_END = "mmserve_front_end"


def main() -> None:
    http_port = int(sys.argv[1])
    shim = os.path.join(os.path.dirname(__file__), "..", "support", "builtin_as_vllm.py")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {FRONT_END: 100}, "include_dashboard": False, "object_store_memory": 200 * 1024**2})
    # CPUs to spare beside its engines: Serve, which spreads replicas over the nodes with room, would
    # put one of each front-end pair here but for the front end's resource.
    engine_node = cluster.add_node(num_cpus=4, resources={"engine_slot": 2}, object_store_memory=200 * 1024**2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port}, proxy_location="HeadOnly")
        args = {
            "model": str(BUILTIN_MODEL_DIR), "served_model_name": "mmserve-builtin",
            "engine_launch": {"count": 2, "resources": {"CPU": 0.5, "engine_slot": 1},
                              "vllm_command": [sys.executable, shim], "engine_args": {"max-model-len": 2048}},
            # Spread by load alone: the prompts share the chat template's prefix, and affinity would
            # rightly keep all eight on one engine within routing.max_imbalance.
            "routing": {"affinity": False},
            "ingress_replicas": 2, "ingress_resources": {FRONT_END: 0.001},
            "preprocessor": {"min_replicas": 2, "max_replicas": 2, "resources": {FRONT_END: 0.001}},
        }
        serve.run(build_app(args), name="mn", route_prefix="/mn", blocking=False)
        # /health answers 200 once one engine is ready; both must be, or every request goes to the first.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{http_port}/mn/health", timeout=5).json()
                if [e["state"] for e in health["engines"]] == ["ready", "ready"]:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        def ask(i: int) -> int:
            return httpx.post(f"http://127.0.0.1:{http_port}/mn/v1/chat/completions", timeout=60, json={
                "model": "mmserve-builtin", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 64,
                "ignore_eos": True}).status_code

        # Concurrent: without affinity the router picks the engine with the fewest requests in flight.
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        placements = [
            serve.get_deployment_handle(f"EngineClient{i}", app_name="mn").launcher_status.remote().result(timeout_s=30)
            for i in range(2)
        ]
        trees = [p["tree"] for p in placements]
        sent = [
            serve.get_deployment_handle(f"EngineClient{i}", app_name="mn").info.remote().result(timeout_s=30).requests_sent
            for i in range(2)
        ]
        front_end_nodes = sorted(
            (actor["ActorClassName"].rsplit(":", 1)[-1], actor["Address"]["NodeID"]) for actor in ray._private.state.actors().values()
            if actor["State"] == "ALIVE" and actor["ActorClassName"] in ("ServeReplica:mn:Ingress", "ServeReplica:mn:Preprocessor")
        )
        serve.delete("mn", _blocking=True)
        left = [pid for tree in trees for pid in tree if os.path.exists(f"/proc/{pid}")]
        print(json.dumps({
            "head_node": cluster.head_node.node_id, "engine_node": engine_node.node_id,
            "placements": [{"client": p["engine_client_node_id"], "engine": p["node_id"]} for p in placements],
            "answers": answers, "requests_per_engine": sent, "engine_pids": trees, "left_after_delete": left,
            "front_end_nodes": front_end_nodes,
        }))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
