"""`ReplicaAdmission`: a preprocessor replica's own limits, `max_ongoing` at work and `max_queued`
waiting in order; the rest refused at once as busy; a waiting request that gives up takes no place."""

from __future__ import annotations

import asyncio

import pytest

from mmserve.multimodal.errors import PreprocessorBusyError
from mmserve.transit.replica_admission import QUEUE_FULL_MESSAGE, ReplicaAdmission


async def _hold(admission: ReplicaAdmission, name: str, order: list[str], release: asyncio.Event) -> None:
    async with admission.admitted():
        order.append(name)
        await release.wait()


def test_past_the_queue_is_refused_at_once_and_the_waiting_go_in_order():
    async def scenario():
        admission = ReplicaAdmission(max_ongoing=2, max_queued=2)
        order: list[str] = []
        releases = {name: asyncio.Event() for name in "abcd"}
        tasks = {name: asyncio.ensure_future(_hold(admission, name, order, releases[name])) for name in "abcd"}
        await asyncio.sleep(0)
        assert order == ["a", "b"] and admission.ongoing == 2 and admission.load == 4
        with pytest.raises(PreprocessorBusyError, match=QUEUE_FULL_MESSAGE):
            async with admission.admitted():
                raise AssertionError("admitted past the queue")
        releases["a"].set()
        await tasks["a"]
        await asyncio.sleep(0)
        assert order == ["a", "b", "c"] and admission.ongoing == 2 and admission.load == 3
        for name in "bcd":
            releases[name].set()
        await asyncio.gather(*tasks.values())
        assert order == ["a", "b", "c", "d"] and admission.ongoing == 0 and admission.load == 0

    asyncio.run(scenario())


def test_a_waiting_request_that_gives_up_takes_no_place_even_when_handed_one():
    async def scenario():
        admission = ReplicaAdmission(max_ongoing=1, max_queued=2)
        order: list[str] = []
        first = admission.admitted()
        await first.__aenter__()
        gives_up = asyncio.ensure_future(_hold(admission, "b", order, asyncio.Event()))
        handed_then_gives_up = asyncio.ensure_future(_hold(admission, "c", order, asyncio.Event()))
        await asyncio.sleep(0)
        gives_up.cancel()  # while waiting
        await asyncio.sleep(0)
        assert admission.load == 2
        await first.__aexit__(None, None, None)  # hands its place to "c" (without yielding the loop) ...
        handed_then_gives_up.cancel()  # ... which gives up before it runs
        await asyncio.gather(gives_up, handed_then_gives_up, return_exceptions=True)
        assert order == [] and admission.ongoing == 0 and admission.load == 0
        await _hold(admission, "d", order, _set())  # the place is free again
        assert order == ["d"]

    asyncio.run(scenario())


def _set() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@pytest.mark.parametrize("ongoing, queued", [(0, 1), (1, -1)])
def test_limits_that_admit_nothing_are_refused(ongoing, queued):
    with pytest.raises(ValueError):
        ReplicaAdmission(ongoing, queued)
