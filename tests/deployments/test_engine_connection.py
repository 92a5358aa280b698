"""`HandleEngineConnection`: a request waits for the engine client's link, bounded, and goes over it;
its answer and outputs come back through the connection's demux."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from deployments.engine_connection import HandleEngineConnection
from mmserve.transit.engine_link import AddAnswer, Admission, OutputBatch, Probe, PromptAccepted, TextRequest, decode_link_request
from mmserve.transit.refusals import GatewayBusyError, Refusal
from mmserve.wire import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from mmserve.transit.sockets import LinkInbox, LinkOutbox


def _request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2], None, SamplingParams(max_tokens=2), None, 0.0, None, None, None)


def _connection(link_timeout_s: float) -> HandleEngineConnection:
    connection = HandleEngineConnection(None, "caller", link_timeout_s)  # type: ignore[arg-type]
    connection._reader = asyncio.get_running_loop().create_future()  # (no Serve subscription here)
    return connection


def test_a_request_with_no_link_open_in_time_is_a_503_to_retry():
    async def scenario():
        connection = _connection(0.2)
        with pytest.raises(GatewayBusyError, match="not reachable within"):
            async for _ in connection.generate(_request("a"), None):
                pass

    asyncio.run(scenario())


def test_a_request_waits_for_the_link_then_goes_over_it_and_its_answer_and_outputs_come_back():
    async def scenario():
        connection = _connection(5.0)
        inbox = LinkInbox("127.0.0.1")
        events = []

        async def consume():
            async for event in connection.generate(_request("a"), None):
                events.append(event)

        consumer = asyncio.ensure_future(consume())
        await asyncio.sleep(0.1)
        assert not events  # waiting for the link
        connection.demux.connected("r1")
        connection.link = LinkOutbox(inbox.address)
        connection._link_open.set()
        message = decode_link_request(await asyncio.wait_for(inbox.recv(), 5))
        assert msgspec.structs.replace(message, stream=0, seq=0) == TextRequest("caller", _request("a"))
        assert (message.stream, message.seq) == (connection.link.stream, 1)
        accepted = PromptAccepted([1, 2])
        connection.demux.dispatch(OutputBatch(answers=[AddAnswer("a", Admission(accepted=accepted))], stream=1, seq=1))
        connection.demux.dispatch(OutputBatch(outputs=[EngineCoreOutput("a", [5])], stream=1, seq=2))
        connection.demux.dispatch(OutputBatch(outputs=[EngineCoreOutput("a", [6], finish_reason=FinishReason.LENGTH)], stream=1, seq=3))
        await asyncio.wait_for(consumer, 5)
        assert events[0].accepted == accepted and all(e.accepted is None for e in events[1:])
        assert [o.new_token_ids for e in events[1:] for o in e.outputs] == [[5], [6]]  # (merged while the consumer lags)
        refused = Refusal("overloaded", "full")
        call = connection.generate(_request("b"), None)
        consumer = asyncio.ensure_future(anext(aiter(call)))
        await asyncio.wait_for(inbox.recv(), 5)
        connection.demux.dispatch(OutputBatch(answers=[AddAnswer("b", Admission(refused=refused))], stream=1, seq=4))
        assert (await asyncio.wait_for(consumer, 5)).refused == refused
        connection.close()
        inbox.close()

    asyncio.run(scenario())


def test_with_requests_in_flight_and_nothing_heard_the_ingress_probes_and_else_it_does_not(monkeypatch):
    import deployments.engine_connection as connection_module

    monkeypatch.setattr(connection_module, "LINK_PROBE_S", 0.1)

    async def scenario():
        connection = _connection(5.0)
        inbox = LinkInbox("127.0.0.1")
        connection.link = LinkOutbox(inbox.address)
        prober = asyncio.ensure_future(connection._probe())
        try:
            idle = await asyncio.wait_for(inbox.recv(), 0.35)  # nothing in flight: nothing sent
        except TimeoutError:
            idle = None
        connection.demux.register("a")
        probe = decode_link_request(await asyncio.wait_for(inbox.recv(), 5))
        prober.cancel()
        connection.close()
        inbox.close()
        return idle, probe

    idle, probe = asyncio.run(scenario())
    assert idle is None
    assert isinstance(probe, Probe) and probe.caller == "caller" and probe.seq == 1
