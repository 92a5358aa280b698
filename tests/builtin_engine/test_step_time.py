"""The built-in engine's steps take a GPU's time: a fixed part, a part per sequence, a part per prefilled
prompt token (`mmserve/builtin_engine/step_time.py`); a step's batch is fixed when it starts."""

from __future__ import annotations

import asyncio

import pytest

from mmserve.builtin_engine import builtin_engine_command
from mmserve.builtin_engine.fake_model import new_generation
from mmserve.builtin_engine.scheduler import GenerationRequest, Scheduler
from mmserve.builtin_engine.step_time import StepTime
from mmserve.builtin_engine.wire_engine_side import ReceivedRequest, ReceivedSampling

from tests.builtin_engine.test_builtin_engine import Engine, make_request, run
from tests.builtin_engine.test_structured_outputs import MODEL, SETTINGS


def generation(request_id: str, prompt: str) -> GenerationRequest:
    sampling = ReceivedSampling(temperature=0.0, max_tokens=50, ignore_eos=True)
    return new_generation(MODEL, SETTINGS, ReceivedRequest(request_id, MODEL.encode(prompt), [], sampling, 0.0), [])


def test_a_steps_time_is_its_fixed_part_plus_its_sequences_and_prefilled_tokens():
    step = StepTime(base_ms=3.0, us_per_sequence=20.0, us_per_prefill_token=40.0)
    assert step.seconds(0, 0) == pytest.approx(0.003)
    assert step.seconds(64, 0) == pytest.approx(0.003 + 64 * 20e-6)
    assert step.seconds(2, 1000) == pytest.approx(0.003 + 2 * 20e-6 + 1000 * 40e-6)
    with pytest.raises(ValueError):
        StepTime(base_ms=-1.0)


def test_a_step_computes_the_batch_it_began_with():
    scheduler = Scheduler(max_num_seqs=2, max_model_len=4096, kv_capacity_tokens=1 << 20)
    for rid, prompt in (("a", "one two three"), ("b", "four five"), ("c", "six")):
        scheduler.add(generation(rid, prompt))
    first = scheduler.begin_step()
    assert first.request_ids == ("a", "b") and first.prefill_tokens == len(MODEL.encode("one two three")) + len(MODEL.encode("four five"))
    scheduler.add(generation("d", "seven"))  # arrives during the step: joins a later one
    scheduler.abort("b")  # aborted during the step: gets no token
    outputs = scheduler.finish_step(first).by_client[0]
    assert [o.request_id for o in outputs] == ["a"]
    second = scheduler.begin_step()
    # "a" decodes (no prefill again); "c" is admitted (prefilled); "d" waits for a free slot.
    assert second.request_ids == ("a", "c") and second.prefill_tokens == len(MODEL.encode("six"))


def _timed(handshake: str, **options) -> list[str]:
    return builtin_engine_command(handshake, **{**options, "step_us_per_sequence": 1000.0, "step_us_per_prefill_token": 500.0})


async def test_tokens_leave_when_their_step_ends():
    """Lower bounds only: a step never ends before its modelled time (a loaded machine may end it later)."""
    engine = await Engine(step_ms=10.0, command=_timed).start()
    try:
        client = engine.client
        prompt = list(range(10, 50))  # 40 tokens: the first step also prefills them
        requests = [make_request(prompt, max_tokens=5, ignore_eos=True) for _ in range(2)]
        answers = await asyncio.gather(*(run(client, r) for r in requests))
        assert all(len(tokens) == 5 for tokens, _ in answers)
        timings = await client.call_utility("get_request_timings", [r.request_id for r in requests], timeout_s=10)
        first_step = (10.0 + 1.0 + 40 * 0.5) / 1e3  # one request's prefill alone, or both requests' at once
        for t in timings:
            assert t["sent"][0] - t["received"] >= first_step * 0.99, t
            gaps = [b - a for a, b in zip(t["sent"], t["sent"][1:])]
            assert min(gaps) >= (10.0 + 1.0) / 1e3 * 0.99, gaps
    finally:
        await engine.stop()
