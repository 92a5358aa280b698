"""n > 1 fan-out: child ids and seeds as vLLM's, children interleaved, one failure fails all."""

from __future__ import annotations

import asyncio

import pytest

from mmserve.openai.parallel_sampling import child_request, interleave
from mmserve.wire import SamplingParams


def test_children_get_indexed_ids_and_consecutive_seeds():
    sampling = SamplingParams(seed=7)
    children = [child_request("chatcmpl-x", [1, 2], sampling, 3, i, 0.0) for i in range(3)]
    assert [c.request_id for c in children] == ["0_chatcmpl-x", "1_chatcmpl-x", "2_chatcmpl-x"]
    assert [c.sampling_params.seed for c in children] == [7, 8, 9]
    assert sampling.seed == 7  # the parent's parameters are not changed


def test_a_single_choice_keeps_the_parents_id_and_seed():
    child = child_request("cmpl-y", [1], SamplingParams(seed=7), 1, 0, 0.0)
    assert (child.request_id, child.sampling_params.seed) == ("cmpl-y", 7)
    unseeded = child_request("cmpl-y", [1], SamplingParams(), 2, 1, 0.0)
    assert unseeded.sampling_params.seed is None


async def _child(index: int, fail_at: int | None = None, closed: list | None = None):
    try:
        for step in range(3):
            await asyncio.sleep(0.001 * (index + 1))
            if step == fail_at:
                raise ValueError(f"child {index} failed")
            yield (index, step)
    finally:
        if closed is not None:
            closed.append(index)


def test_children_interleave_as_they_arrive():
    async def run():
        return [item async for item in interleave(3, _child)]

    items = asyncio.run(run())
    assert sorted(items) == [(i, s) for i in range(3) for s in range(3)]
    assert items[0] == (0, 0)  # the fastest child's first item first


def test_the_first_failure_fails_the_request_and_closes_the_others():
    closed: list[int] = []

    async def run():
        async for _ in interleave(3, lambda i: _child(i, fail_at=1 if i == 0 else None, closed=closed)):
            pass

    with pytest.raises(ValueError, match="child 0 failed"):
        asyncio.run(run())
    assert sorted(closed) == [0, 1, 2]
