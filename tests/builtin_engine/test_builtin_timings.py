"""The built-in engine's `get_request_timings` utility (per-request wall times for benchmarks)."""

from __future__ import annotations

import time

import pytest

from mmserve.builtin_engine import timings as timings_module
from mmserve.builtin_engine import BuiltinEngine
from tests.support.defaults import builtin_engine_settings
from mmserve.builtin_engine.wire_engine_side import ReceivedRequest, ReceivedSampling

from tests.builtin_engine.test_builtin_engine import MODEL_DIR, Engine, make_request, run



@pytest.fixture(scope="module")
async def engine():
    eng = await Engine(step_ms=1.0).start()
    yield eng
    await eng.stop()


async def test_timings_over_the_wire(engine):
    client = engine.client
    await client.call_utility("get_request_timings", None, True, timeout_s=10)  # start clean
    before = time.time()
    request = make_request([10, 11, 12], max_tokens=5, ignore_eos=True)
    tokens, last = await run(client, request)
    after = time.time()
    assert len(tokens) == 5 and last.finished

    timings = await client.call_utility("get_request_timings", timeout_s=10)
    assert [t["request_id"] for t in timings] == [request.request_id]
    t = timings[0]
    assert t["arrival_time"] == pytest.approx(request.arrival_time)
    assert before <= t["arrival_time"] <= t["received"] <= t["sent"][0] <= after
    assert t["sent"] == sorted(t["sent"])
    assert t["num_tokens"] == [1] * 5

    # Selected ids only; unknown ids are skipped; clear forgets.
    assert await client.call_utility("get_request_timings", ["nope"], timeout_s=10) == []
    selected = await client.call_utility("get_request_timings", [request.request_id], True, timeout_s=10)
    assert selected == timings
    assert await client.call_utility("get_request_timings", timeout_s=10) == []


def test_timings_are_bounded(monkeypatch):
    """The last TIMINGS_MAX_REQUESTS requests, the first TIMINGS_MAX_FRAMES frames of each."""
    monkeypatch.setattr(timings_module, "TIMINGS_MAX_REQUESTS", 3)
    monkeypatch.setattr(timings_module, "TIMINGS_MAX_FRAMES", 4)
    eng = BuiltinEngine(builtin_engine_settings("tcp://127.0.0.1:1", model_dir=MODEL_DIR))
    sent: list[dict] = []
    eng._send_outputs = lambda client_index, outputs: sent.append(outputs)  # no sockets
    try:
        for i in range(5):
            eng._add(ReceivedRequest(f"r{i}", [10, 11, 12], [], ReceivedSampling(temperature=0.0, max_tokens=10, ignore_eos=True), 1.0 + i))
        assert [t["request_id"] for t in eng.get_request_timings()] == ["r2", "r3", "r4"]
        for _ in range(10):
            eng._finish_step(eng.scheduler.begin_step())
        timings = eng.get_request_timings()
        assert all(len(t["sent"]) == 4 and t["num_tokens"] == [1] * 4 for t in timings)
        assert [t["arrival_time"] for t in timings] == [3.0, 4.0, 5.0]
        assert len(sent) == 10
    finally:
        eng._ctx.term()
