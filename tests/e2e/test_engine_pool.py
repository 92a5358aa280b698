"""An engine pool (issue 20): built-in engines as the replicas of one deployment that Serve scales
with the requests they hold, routed to by name through Serve's request-router API, drained before
they are taken away."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import deploy_app
from tests.e2e.fault_support import wait_for

pytestmark = pytest.mark.serve

BUILTIN = "mmserve-builtin"
# The built-in engine's step: 20 ms per token, so a 150-token stream takes ≈3 s, a 900-token one ≈18 s.
STEP_MS = 20.0
SHORT_TOKENS, LONG_TOKENS = 150, 900
POOL = {
    "min_engines": 1, "max_engines": 2, "target_requests_per_engine": 4,
    "upscale_delay_s": 1, "downscale_delay_s": 4, "look_back_period_s": 2, "drain_timeout_s": 120,
}


def _engines(base_url: str) -> list[dict]:
    return httpx.get(base_url + "/health", timeout=30).json()["engines"]


async def _stream(client: httpx.AsyncClient, url: str, tokens: int, n: int) -> tuple[int, int, str | None]:
    """One streamed chat of exactly `tokens` tokens: (status, tokens received, finish reason)."""
    body = {"model": BUILTIN, "messages": [{"role": "user", "content": f"request {n}"}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    received, finish = 0, None
    async with client.stream("POST", url, json=body, timeout=120) as response:
        if response.status_code != 200:
            return response.status_code, 0, (await response.aread()).decode()[:200]
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the stream failed after it began
                return 200, received, f"error: {chunk['error'].get('message')}"
            if chunk.get("usage"):
                received = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                finish = choice.get("finish_reason") or finish
    return 200, received, finish


def test_the_pool_grows_with_the_load_and_drains_an_engine_before_taking_it_away(serve_instance):
    """Load rises: the pool goes from one engine to two and both serve. Load falls to four long
    streams spread over both: one engine is taken away while its streams still run, and they finish
    whole (the ingress stopped sending it work, and let it go only once they were done). No request
    is lost or fails at any point."""
    name = "enginepool"
    app = deploy_app(serve_instance, name, {"engine_pool": POOL, "builtin_engine": {"step_interval_ms": STEP_MS}})
    try:
        _scale_drain_and_shrink(app, name)
    finally:
        # Its replicas and engines would hold memory for the rest of the session's shared instance
        # (a full run beside it reached Ray's OOM threshold, which killed Serve's controller).
        from ray import serve

        serve.delete(name, _blocking=True)


def _scale_drain_and_shrink(app, name: str) -> None:
    import ray

    url = app.base_url + "/v1/chat/completions"
    assert [e["state"] for e in _engines(app.base_url)] == ["ready"]

    async def scenario() -> dict:
        results: list[tuple[int, int, str | None]] = []
        timeline: dict[str, float] = {}
        async with httpx.AsyncClient() as client:
            rising = asyncio.Event()
            counter = iter(range(10**6))

            async def short_worker() -> None:
                while not rising.is_set():
                    results.append(await _stream(client, url, SHORT_TOKENS, next(counter)))

            start = time.monotonic()
            workers = [asyncio.create_task(short_worker()) for _ in range(12)]
            while True:  # until a second engine serves
                engines = await asyncio.to_thread(_engines, app.base_url)
                if len(engines) == 2 and all(e["state"] == "ready" and e["in_flight"] for e in engines):
                    timeline["second_engine_serving_s"] = time.monotonic() - start
                    break
                assert time.monotonic() - start < 90, f"no second engine serving after 90 s: {engines}"
                await asyncio.sleep(0.2)
            # Four long streams, spread by load over the two engines, then the short load stops.
            long_streams = [asyncio.create_task(_stream(client, url, LONG_TOKENS, next(counter))) for _ in range(4)]
            await asyncio.sleep(1.0)
            rising.set()
            await asyncio.gather(*workers)
            shrink_start = time.monotonic()
            while len(await asyncio.to_thread(_engines, app.base_url)) != 1:
                assert time.monotonic() - shrink_start < 60, "the pool did not shrink"
                await asyncio.sleep(0.2)
            timeline["one_engine_listed_after_s"] = time.monotonic() - shrink_start
            timeline["long_streams_running_then"] = sum(not t.done() for t in long_streams)
            results += await asyncio.gather(*long_streams)
        return {"results": results, "timeline": timeline}

    outcome = asyncio.run(scenario())
    results, timeline = outcome["results"], outcome["timeline"]
    print(f"engine pool: {len(results)} streams; {timeline}")
    failed = [r for r in results if r[0] != 200 or r[2] != "length"]
    assert failed == [], failed[:5]
    assert sorted({r[1] for r in results}) == [SHORT_TOKENS, LONG_TOKENS]
    # The engine was taken away while long streams ran (they started ≈1 s before the short load
    # stopped and last ≈18 s), and the ingress drained it: its log says how many were still there.
    assert timeline["long_streams_running_then"] == 4
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    drained = [
        int(line.rsplit("draining its ", 1)[1].split()[0])
        for path in logs.glob(f"replica_{name}_Ingress_*.log")
        for line in path.read_text(errors="replace").splitlines()
        if "is being taken away: draining its" in line
    ]
    assert drained and max(drained) >= 1, drained
    # Its streams done, the ingress lets the replica go: Serve stops it then, not at drain_timeout_s.
    wait_for(lambda: _pool_replica_states(name) == {"RUNNING": 1}, 20, "the drained replica stopped")
    assert [e["state"] for e in _engines(app.base_url)] == ["ready"]


def _pool_replica_states(app_name: str) -> dict[str, int]:
    from ray import serve

    states = serve.status().applications[app_name].deployments["EnginePool"].replica_states
    return {str(getattr(state, "value", state)): count for state, count in states.items() if count}


def test_engines_whose_kv_caches_fill_grow_the_pool_though_their_requests_are_few(serve_instance):
    """Two long streams fill a built-in engine's KV cache (1024 tokens × 2 sequences) past
    `target_kv_cache_usage` (0.3: ≈620 tokens; each stream ≈220 prompt tokens and 600 out), while the
    requests it holds (2) are far below `target_requests_per_engine` (100): the pool grows to a
    second engine on the KV-cache term alone."""
    name = "enginepool-kv"
    pool = {**POOL, "target_requests_per_engine": 100, "target_kv_cache_usage": 0.3}
    app = deploy_app(serve_instance, name, {"engine_pool": pool, "builtin_engine": {
        "step_interval_ms": STEP_MS, "max_model_len": 1024, "max_num_seqs": 2}})
    url = app.base_url + "/v1/chat/completions"
    try:
        async def scenario() -> tuple[list, float | None]:
            async with httpx.AsyncClient() as client:
                prompt = " ".join("word" for _ in range(100))  # ≈200 tokens with the built-in tokenizer
                streams = []
                for n in range(2):
                    body = {"model": BUILTIN, "messages": [{"role": "user", "content": f"{n} {prompt}"}], "max_tokens": 600,
                            "ignore_eos": True, "stream": True}
                    streams.append(asyncio.create_task(client.post(url, json=body, timeout=120)))
                start, grown = time.monotonic(), None
                while time.monotonic() - start < 30 and not all(s.done() for s in streams):
                    if len(await asyncio.to_thread(_engines, app.base_url)) == 2:
                        grown = time.monotonic() - start
                        break
                    await asyncio.sleep(0.2)
                return [(await s).status_code for s in streams], grown

        statuses, grown = asyncio.run(scenario())
        print(f"engine pool on KV-cache usage: second engine after {grown} s")
        assert statuses == [200, 200]
        assert grown is not None, "the pool did not grow while two long contexts filled the engine's KV cache"
    finally:
        from ray import serve

        serve.delete(name, _blocking=True)
