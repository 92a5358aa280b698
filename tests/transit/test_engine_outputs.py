"""The ingress end of an engine client's output stream: outputs and answers to their requests, merged while a consumer lags; lost streams fail what they carried."""

from __future__ import annotations

import asyncio

import pytest

from mmserve.engine import EngineDeadError
from mmserve.transit.engine_outputs import OutputDemux
from mmserve.transit.engine_link import AddAnswer, Admission, OutputBatch, PromptAccepted, RequestFailed
from mmserve.transit.refusals import LinkLost
from mmserve.wire import EngineCoreOutput, FinishReason


class Stream:
    """Numbers batches as an engine client's outbox does (one stream)."""

    def __init__(self, stream: int = 1) -> None:
        self.stream, self.seq = stream, 0

    def __call__(self, *args, **kwargs) -> OutputBatch:
        self.seq += 1
        return OutputBatch(*args, **kwargs, stream=self.stream, seq=self.seq)


def test_batches_are_split_by_request_and_merged_for_a_lagging_consumer():
    async def run():
        demux, batch = OutputDemux(), Stream()
        a, b = demux.register("a"), demux.register("b")
        demux.dispatch(batch([EngineCoreOutput("a", [1]), EngineCoreOutput("b", [2]), EngineCoreOutput("x", [9])]))
        demux.dispatch(batch([EngineCoreOutput("a", [3], finish_reason=FinishReason.STOP)], [RequestFailed("b", "engine died")]))
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
        demux.lost(LinkLost("stream broke"))
        with pytest.raises(LinkLost):
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
    assert isinstance(old_error, LinkLost) and new_error is None


def test_an_answer_reaches_its_request_even_after_its_outputs():
    async def run():
        demux, batch = OutputDemux(), Stream()
        request = demux.register("a")
        request.awaiting_answer = True
        answer = AddAnswer("a", Admission(accepted=PromptAccepted([1, 2])))
        waiting = asyncio.create_task(request.next_answer())
        demux.dispatch(batch([EngineCoreOutput("a", [1])]))  # the outputs first: the answer is still awaited
        await asyncio.sleep(0.01)
        pending = not waiting.done()
        demux.dispatch(batch(answers=[answer, AddAnswer("unknown", Admission())]))
        got = await asyncio.wait_for(waiting, 1)
        return pending, got, answer, await request.next(), request.awaiting_answer

    pending, got, answer, outputs, still_awaiting = asyncio.run(run())
    assert pending, "outputs do not stand for the answer"
    assert got == answer
    assert [o.new_token_ids for o in outputs] == [[1]], "outputs that came first are kept"
    assert not still_awaiting


def test_a_lost_stream_fails_requests_whose_answer_had_not_come():
    async def run():
        demux = OutputDemux()
        sent, registered = demux.register("s"), demux.register("r")
        sent.awaiting_answer = True
        demux.lost(LinkLost("stream broke"))
        with pytest.raises(LinkLost):
            await asyncio.wait_for(sent.next_answer(), 1)
        return registered.error

    assert asyncio.run(run()) is None, "a request not sent yet learns its fate when it is"


def test_the_engine_clients_word_that_requests_were_lost_fails_those_in_flight():
    """Messages from the ingress were lost (found at the engine client, which aborted the caller's
    requests): every request in flight here fails, to be sent again if nothing was generated."""
    async def run():
        demux, batch = OutputDemux(), Stream()
        admitted, sent = demux.register("a"), demux.register("s")
        admitted.replica = "r1"
        sent.awaiting_answer = True
        demux.dispatch(batch([EngineCoreOutput("a", [1])]))
        demux.dispatch(batch(lost=True))
        return await admitted.next(), admitted.error, sent.error

    outputs, admitted_error, sent_error = asyncio.run(run())
    assert [o.new_token_ids for o in outputs] == [[1]]
    assert isinstance(admitted_error, LinkLost) and isinstance(sent_error, LinkLost)



def _numbered(stream: int, seq: int, request_id: str, token: int) -> OutputBatch:
    return OutputBatch([EngineCoreOutput(request_id, [token])], stream=stream, seq=seq)


def test_a_batch_lost_on_the_way_fails_the_requests_in_flight_and_the_stream_goes_on():
    """Numbered batches, one number skipped (a broken connection that ZMQ remade): which requests
    missed outputs is unknown, so every one in flight fails; later requests are served."""
    async def run():
        demux = OutputDemux()
        a, b = demux.register("a"), demux.register("b")
        a.replica = b.replica = "r1"
        demux.dispatch(_numbered(7, 1, "a", 1))
        demux.dispatch(_numbered(7, 2, "b", 2))
        demux.dispatch(_numbered(7, 4, "a", 4))  # 3 never came
        got_a = await a.next()
        with pytest.raises(LinkLost, match="lost on the way"):
            await asyncio.wait_for(a.next(), 1)
        got_b = await b.next()
        with pytest.raises(LinkLost):
            await asyncio.wait_for(b.next(), 1)
        later = demux.register("c")
        later.replica = "r1"
        demux.dispatch(_numbered(7, 5, "c", 5))
        return got_a, got_b, await asyncio.wait_for(later.next(), 1), later.error

    got_a, got_b, got_later, later_error = asyncio.run(run())
    assert [o.new_token_ids for o in got_a] == [[1]], "the batch after the gap is not delivered"
    assert [o.new_token_ids for o in got_b] == [[2]], "what arrived before the gap is delivered first"
    assert [o.new_token_ids for o in got_later] == [[5]] and later_error is None


def test_batch_numbers_are_per_stream_and_an_older_streams_late_batch_fails_nothing():
    async def run():
        demux = OutputDemux()
        demux.dispatch(_numbered(1, 1, "x", 0))
        demux.dispatch(_numbered(1, 2, "x", 0))
        request = demux.register("a")
        request.replica = "r2"
        demux.dispatch(_numbered(2, 1, "a", 1))  # a new stream (subscribed again) starts at 1
        demux.dispatch(_numbered(1, 4, "x", 0))  # the old stream's late batch, after a gap of its own
        demux.dispatch(_numbered(2, 2, "a", 2))
        demux.dispatch(_numbered(2, 3, "a", 3))
        return request.error, await asyncio.wait_for(request.next(), 1)

    error, outputs = asyncio.run(run())
    assert error is None and [o.new_token_ids for o in outputs] == [[1], [2], [3]]


def test_a_new_stream_whose_first_batch_never_came_fails_its_requests():
    async def run():
        demux = OutputDemux()
        request = demux.register("a")
        request.awaiting_answer = True
        demux.dispatch(_numbered(9, 2, "a", 1))
        return request.error

    assert isinstance(asyncio.run(run()), LinkLost)
