"""No pixels outlive their requests: after 500 image requests, and again after a preprocessor replica and
an engine client are killed under load, the object store's used memory is back at its idle level within
10 s, and every request was answered or failed (none waits forever)."""

from __future__ import annotations

import asyncio
import time

import httpx
import psutil
import pytest
import ray
from ray import serve

from tests.conftest import deploy_app
from tests.e2e.test_faults_replicas import _kill_replica
from tests.support.images import image_uri

pytestmark = pytest.mark.serve

NAME = "objects"
IDLE_WITHIN_S = 10.0
# Ray keeps objects up to this size in its workers' memory (`max_direct_call_object_size`), not in the store.
RAY_INLINE_LIMIT = 100 * 1024


def _store_used() -> int:
    """Bytes in use in this node's object store (the raylet's own count), less the objects Serve's
    controller holds: its own (it keeps one more after a replica was replaced), none of the application's."""
    from ray._private.internal_api import node_stats

    [node] = [n for n in ray.nodes() if n["Alive"]]
    stats = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=True)
    controller = {
        ref.object_id: ref.object_size
        for worker in stats.core_workers_stats if _process_title(worker.pid).startswith("ray::ServeController")
        for ref in worker.object_refs if ref.object_size > RAY_INLINE_LIMIT
    }
    return stats.store_stats.object_store_bytes_used - sum(controller.values())


def _process_title(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:60]
    except psutil.Error:
        return "gone"


def _holders() -> str:
    """Who holds which object in the store (each worker's references, with their sizes and call sites)."""
    from ray._private.internal_api import node_stats

    [node] = [n for n in ray.nodes() if n["Alive"]]
    stats = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=True)
    lines = []
    for worker in stats.core_workers_stats:
        for ref in worker.object_refs:
            if ref.object_size > 10_000:
                lines.append(f"pid {worker.pid} ({_process_title(worker.pid)}): {ref.object_size} bytes, "
                             f"{ref.call_site or '?'} (local {ref.local_ref_count}, submitted {ref.submitted_task_ref_count}, pinned {ref.pinned_in_memory})")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def app(serve_instance):
    deployed = deploy_app(serve_instance, NAME, {
        "builtin_engine": {"step_interval_ms": 2.0},
        "preprocessor": {"min_replicas": 1, "max_replicas": 1},
        "images": {"cache_bytes": 0},  # every request writes its pixels anew
    })
    yield deployed
    serve.delete(NAME, _blocking=True)


def _body(i: int) -> dict:
    # Distinct images of some 0.4 MB of pixels each: well over the size that goes through the store.
    image = image_uri(320 + i % 16, 240, seed=i)
    return {"model": "mmserve-builtin", "max_tokens": 2, "stream": i % 3 == 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": image}}]}]}


async def _load(app, count: int | None, concurrency: int, stop: asyncio.Event | None = None) -> list:
    """`count` requests (or until `stop`), `concurrency` at once; each one's status, or its transport error."""
    outcomes: list = []
    numbers = iter(range(10**9))

    async def worker(client: httpx.AsyncClient) -> None:
        while not (stop is not None and stop.is_set()):
            i = next(numbers)
            if count is not None and i >= count:
                return
            try:
                response = await client.post(app.base_url + "/v1/chat/completions", json=_body(i))
                outcomes.append(response.status_code)
            except httpx.TimeoutException as exc:
                outcomes.append(f"timed out: {exc!r}")
            except httpx.HTTPError as exc:
                outcomes.append(f"transport: {exc!r}")

    async with httpx.AsyncClient(timeout=90) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return outcomes


def _back_to_idle(idle: int, within_s: float = IDLE_WITHIN_S) -> float:
    """Seconds until the store is back at `idle` bytes (or less); fails after `within_s`."""
    start = time.monotonic()
    while (used := _store_used()) > idle:
        assert time.monotonic() - start < within_s, f"{used - idle} bytes still held {within_s:.0f} s after the load:\n{_holders()}"
        time.sleep(0.1)
    return time.monotonic() - start


def test_500_image_requests_leave_nothing_in_the_object_store(app):
    asyncio.run(_load(app, 8, 4))  # warm: the links attached, the resize compiled
    time.sleep(1.0)
    idle = _store_used()
    outcomes = asyncio.run(_load(app, 500, 8))
    assert outcomes.count(200) == 500, sorted(set(map(str, outcomes)))
    print(f"idle again {_back_to_idle(idle):.2f} s after 500 image requests ({idle} bytes idle)")


def test_killing_a_preprocessor_replica_and_an_engine_client_under_load_leaves_nothing_and_no_request_waits(app):
    idle = _store_used()

    async def scenario() -> list:
        stop = asyncio.Event()
        load = asyncio.ensure_future(_load(app, None, 8, stop))
        await asyncio.sleep(2.0)
        await asyncio.to_thread(_kill_replica, NAME, "Preprocessor")
        await asyncio.sleep(2.0)
        await asyncio.to_thread(_kill_replica, NAME, "EngineClient0")
        # Until both are replaced and image requests are served again.
        deadline = time.monotonic() + 120
        async with httpx.AsyncClient(timeout=60) as client:
            while time.monotonic() < deadline:
                response = await client.post(app.base_url + "/v1/chat/completions", json=_body(10**6))
                if response.status_code == 200:
                    break
                await asyncio.sleep(0.5)
            else:
                raise AssertionError("image requests were not served again within 120 s of the kills")
        await asyncio.sleep(2.0)  # (load on the replacements)
        stop.set()
        return await load

    outcomes = asyncio.run(scenario())
    waited = [o for o in outcomes if isinstance(o, str)]
    assert not waited, waited[:3]  # every request answered, success or error, none cut off or left waiting
    assert 200 in outcomes and set(outcomes) <= {200, 503}, sorted(set(map(str, outcomes)))
    print(f"{len(outcomes)} requests ({outcomes.count(503)} 503s); idle again {_back_to_idle(idle):.2f} s after the load")
