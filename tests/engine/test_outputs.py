"""The engine client's per-caller channel: outputs of many requests merged while the caller lags; late ADDs of aborted ids refused."""

from __future__ import annotations

import asyncio

from mmserve.engine import EngineDeadError
from mmserve.engine.outputs import CallerChannel
from mmserve.wire import EngineCoreOutput, FinishReason


def test_outputs_of_many_requests_arrive_as_one_merged_batch_while_the_caller_lags():
    async def run():
        channel = CallerChannel()
        for request_id in ("a", "b"):
            assert channel.track(request_id)
        channel.put(EngineCoreOutput("a", [1]))
        channel.put(EngineCoreOutput("b", [2]))
        channel.put(EngineCoreOutput("a", [3], finish_reason=FinishReason.LENGTH))
        channel.fail("b", EngineDeadError("engine gone"))
        first = await channel.take()
        waiting = asyncio.create_task(channel.take())
        await asyncio.sleep(0.01)
        pending = not waiting.done()
        channel.put(EngineCoreOutput("c", [4]))
        second = await asyncio.wait_for(waiting, 1)
        return first, pending, second, channel.request_ids

    (outputs, failures, answers), pending, (later, _, _), tracked = asyncio.run(run())
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [1]), ("b", [2]), ("a", [3])]
    assert failures == [("b", "engine gone")]
    assert answers == []
    assert pending, "take() waits while nothing arrived"
    assert [o.request_id for o in later] == ["c"]
    assert tracked == set(), "finished and failed requests are no longer the caller's"


def test_an_answer_wakes_a_waiting_caller_and_is_taken_once():
    async def run():
        channel: CallerChannel[str] = CallerChannel()
        waiting = asyncio.create_task(channel.take())
        await asyncio.sleep(0.01)
        pending = not waiting.done()
        channel.answer("admitted a")
        taken = await asyncio.wait_for(waiting, 1)
        return pending, taken, channel.pending

    pending, taken, still_pending = asyncio.run(run())
    assert pending, "take() waits while nothing arrived"
    assert taken.answers == ["admitted a"] and taken.outputs == [] and taken.failures == []
    assert not still_pending


def test_an_abort_that_overtakes_its_add_makes_the_add_refused():
    channel = CallerChannel()
    assert channel.track("a")
    channel.aborted(["a", "late"])
    assert channel.request_ids == set()
    assert not channel.track("late")
    assert channel.track("late"), "remembered once only"
