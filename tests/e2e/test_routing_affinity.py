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
    import ray

    from tests.support.vllm_engines import free_tcp_port

    name = f"routing-affinity-{ingress_replicas}"
    ports = [free_tcp_port(), free_tcp_port()]
    procs = [_start_builtin(p) for p in ports]
    try:
        app = deploy_app(serve_instance, name, {"engines": [f"tcp://127.0.0.1:{p}" for p in ports],
                                              "served_model_name": BUILTIN, "routing": {"max_imbalance": 2},
                                              "ingress_replicas": ingress_replicas})
        wait_for(lambda: all(app.engine_info(i).state == "ready" for i in (0, 1)), 60, "both engines ready")
        client = app.openai()
        images = [image_uri(48 + 8 * k, 40, seed=k) for k in range(6)]
        prefixes = [" ".join(f"topic{k} word{w}" for w in range(150)) for k in range(4)]
        work = [("image", k) for k in range(6) for _ in range(4)] + [("prefix", k) for k in range(4) for _ in range(4)]
        random.Random(3).shuffle(work)
        first: dict[tuple[str, int], int] = {}
        repeats = to_first = image_repeats_to_first = 0
        for n, (kind, k) in enumerate(work):
            sent = [app.engine_info(i).requests_sent for i in (0, 1)]
            if kind == "image":
                content = [image_part(images[k]), {"type": "text", "text": f"question {n}"}]
            else:
                content = f"{prefixes[k]}\nquestion {n}"
            client.chat.completions.create(model=BUILTIN, messages=[{"role": "user", "content": content}], max_tokens=2)
            served = [app.engine_info(i).requests_sent - sent[i] for i in (0, 1)]
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
        skipped = sum(app.engine_info(i).mm_items_skipped for i in (0, 1))
        assert skipped == image_repeats_to_first >= 0.9 * 18
        logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
        answered = [p.read_text(errors="replace").count('"endpoint":"chat"') for p in logs_dir.glob(f"replica_{name}_Ingress_*.log")]
        assert sum(answered) == len(work) and len([n for n in answered if n > 0]) == ingress_replicas, answered
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        serve.delete(name, _blocking=True)
