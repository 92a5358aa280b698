"""The ingress end of an engine client's output stream: outputs and answers to their requests, merged while a consumer lags; lost streams fail what they carried."""

from __future__ import annotations

import asyncio

import pytest

from mmserve.engine import EngineDeadError
from mmserve.openai.engine_outputs import OutputDemux
from mmserve.openai.engine_router import ReplicaLostError
from mmserve.protocol import AddAnswer, Admission, OutputBatch, RequestFailed
from mmserve.wire import EngineCoreOutput, FinishReason


def test_batches_are_split_by_request_and_merged_for_a_lagging_consumer():
    async def run():
        demux = OutputDemux()
        a, b = demux.register("a"), demux.register("b")
        demux.dispatch(OutputBatch([EngineCoreOutput("a", [1]), EngineCoreOutput("b", [2]), EngineCoreOutput("x", [9])]))
        demux.dispatch(OutputBatch([EngineCoreOutput("a", [3], finish_reason=FinishReason.STOP)], [RequestFailed("b", "engine died")]))
        got_a = await a.next()
        got_b = await b.next()
        with pytest.raises(EngineDeadError, match="engine died"):
            await b.next()
        return got_a, got_b

    got_a, got_b = asyncio.run(run())
    assert [o.new_token_ids for o in got_a] == [[1], [3]], "two batches, taken as one"
    assert [o.new_token_ids for o in got_b] == [[2]], "outputs before the failure are delivered first"


def test_a_lost_stream_fails_admitted_requests_and_a_new_replica_fails_the_old_ones():
    async def run():
        demux = OutputDemux()
        admitted, pending = demux.register("a"), demux.register("p")
        admitted.replica = "r1"
        demux.lost(ReplicaLostError("stream broke"))
        with pytest.raises(ReplicaLostError):
            await admitted.next()
        still_pending = pending.error is None
        old = demux.register("o")
        old.replica = "r1"
        new = demux.register("n")
        new.replica = "r2"
        demux.connected("r2")
        return still_pending, old.error, new.error

    still_pending, old_error, new_error = asyncio.run(run())
    assert still_pending, "a request whose add is under way learns its fate from the add"
    assert isinstance(old_error, ReplicaLostError) and new_error is None


def test_an_answer_over_the_link_reaches_its_request_even_after_its_outputs():
    async def run():
        demux = OutputDemux()
        request = demux.register("a")
        request.awaiting_answer = True
        answer = AddAnswer("a", admission=Admission(replica="r1"))
        waiting = asyncio.create_task(request.next_answer())
        demux.dispatch(OutputBatch([EngineCoreOutput("a", [1])]))  # the outputs first: the answer is still awaited
        await asyncio.sleep(0.01)
        pending = not waiting.done()
        demux.dispatch(OutputBatch(answers=[answer, AddAnswer("unknown", admission=Admission())]))
        got = await asyncio.wait_for(waiting, 1)
        return pending, got, await request.next(), request.awaiting_answer

    pending, got, outputs, still_awaiting = asyncio.run(run())
    assert pending, "outputs do not stand for the answer"
    assert got == AddAnswer("a", admission=Admission(replica="r1"))
    assert [o.new_token_ids for o in outputs] == [[1]], "outputs that came first are kept"
    assert not still_awaiting


def test_a_lost_stream_fails_requests_whose_answer_over_the_link_had_not_come():
    async def run():
        demux = OutputDemux()
        over_link, over_ray = demux.register("l"), demux.register("r")
        over_link.awaiting_answer = True
        demux.lost(ReplicaLostError("stream broke"))
        with pytest.raises(ReplicaLostError):
            await asyncio.wait_for(over_link.next_answer(), 1)
        return over_ray.error

    assert asyncio.run(run()) is None, "an add over Ray learns its fate from its call"

