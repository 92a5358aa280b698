"""Routing with cache affinity through the whole Serve graph, over two external built-in engines."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest
from ray import serve

from tests.conftest import deploy_app
from tests.e2e.fault_support import wait_for
from tests.support.images import image_part, image_uri

pytestmark = pytest.mark.serve

BUILTIN = "mmserve-builtin"


def _start_builtin(port: int) -> subprocess.Popen:
    from tests.support.defaults import builtin_engine_argv

    return subprocess.Popen(
        builtin_engine_argv(f"tcp://127.0.0.1:{port}", step_interval_ms=2.0),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


@pytest.mark.parametrize("ingress_replicas", [1, 2])
def test_repeated_images_and_prefixes_go_to_the_engine_that_served_them(serve_instance, ingress_replicas):
    """Six images and four long shared prompt prefixes, each sent four times in random order: the
    repeats land on the engine that served them first (which the engines' request counts show),
    both engines get new content, and every repeated image reaches an engine that already holds
    it, so it is sent by hash only (the engine clients' skip-resend counts). With two ingress
    replicas (each with its own table, both taking requests: their request logs show it) too."""
    from tests.support.vllm_engines import free_tcp_port

    name = f"routing-affinity-{ingress_replicas}"
    ports = [free_tcp_port(), free_tcp_port()]
    procs = [_start_builtin(p) for p in ports]
    try:
        app = deploy_app(serve_instance, name, {"engines": [f"tcp://127.0.0.1:{p}" for p in ports],
                                              "served_model_name": BUILTIN, "routing": {"max_imbalance": 2},
                                              "ingress_replicas": ingress_replicas})
        wait_for(lambda: all(app.engine_info(i).state == "ready" for i in (0, 1)), 60, "both engines ready")
        _repeats_reach_their_first_engine(app, name, ingress_replicas, lambda: [app.engine_info(i) for i in (0, 1)])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        serve.delete(name, _blocking=True)


def test_in_an_engine_pool_every_ingress_replica_sends_repeats_to_the_engine_that_served_them(serve_instance):
    """The same with an engine pool of two (built-in engines as the replicas of one deployment) and
    two ingress replicas: each replica hashes the content over the pool's replica ids, which Serve
    gives every router alike, so the affinity is shared with no table and no call between them."""
    import httpx

    name = "routing-affinity-pool"
    app = deploy_app(serve_instance, name, {"engine_pool": {"min_engines": 2, "max_engines": 2},
                                          "builtin_engine": {"step_interval_ms": 2.0},
                                          "routing": {"max_imbalance": 2}, "ingress_replicas": 2})
    try:
        def engine_ids() -> list[str]:
            return sorted(e["engine"] for e in httpx.get(app.base_url + "/health", timeout=30).json()["engines"] if e["state"] == "ready")

        wait_for(lambda: len(engine_ids()) == 2, 120, "both pool engines ready")
        engines = engine_ids()
        pool = serve.get_deployment_handle("EnginePool", app_name=name)
        # Each call names its replica (the pool's request router delivers it there).
        _repeats_reach_their_first_engine(app, name, 2, lambda: [pool.info.remote(engine=e).result(timeout_s=30) for e in engines])
        assert engine_ids() == engines  # the same two engines throughout
    finally:
        serve.delete(name, _blocking=True)


def _repeats_reach_their_first_engine(app, name: str, ingress_replicas: int, engine_infos) -> None:
    import ray

    client = app.openai()
    images = [image_uri(48 + 8 * k, 40, seed=k) for k in range(6)]
    prefixes = [" ".join(f"topic{k} word{w}" for w in range(150)) for k in range(4)]
    work = [("image", k) for k in range(6) for _ in range(4)] + [("prefix", k) for k in range(4) for _ in range(4)]
    random.Random(3).shuffle(work)
    first: dict[tuple[str, int], int] = {}
    repeats = to_first = image_repeats_to_first = 0
    for n, (kind, k) in enumerate(work):
        sent = [info.requests_sent for info in engine_infos()]
        if kind == "image":
            content = [image_part(images[k]), {"type": "text", "text": f"question {n}"}]
        else:
            content = f"{prefixes[k]}\nquestion {n}"
        client.chat.completions.create(model=BUILTIN, messages=[{"role": "user", "content": content}], max_tokens=2)
        served = [info.requests_sent - before for info, before in zip(engine_infos(), sent)]
        assert sorted(served) == [0, 1], served
        engine = served.index(1)
        if (kind, k) in first:
            repeats += 1
            to_first += engine == first[(kind, k)]
            image_repeats_to_first += kind == "image" and engine == first[(kind, k)]
        else:
            first[(kind, k)] = engine
    print(f"repeats to their first engine: {to_first}/{repeats}; first engines: {sorted(first.values())}")
    assert to_first / repeats >= 0.9
    assert set(first.values()) == {0, 1}  # new content spreads over both engines
    skipped = sum(info.mm_items_skipped for info in engine_infos())
    assert skipped == image_repeats_to_first >= 0.9 * 18
    logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    answered = [p.read_text(errors="replace").count('"endpoint":"chat"') for p in logs_dir.glob(f"replica_{name}_Ingress_*.log")]
    assert sum(answered) == len(work) and len([n for n in answered if n > 0]) == ingress_replicas, answered
