"""A message lost on the link from an ingress replica to a real engine client (as a connection that ZMQ
remade would lose it) is found by its number, at the latest when the caller probes: the engine client
aborts the caller's requests in its engine and says so in its next batch, which fails them at the
caller. Played here by a caller of the test's own, speaking the engine link as an ingress replica does."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from mmserve.transit.engine_link import OutputBatch, Probe, TextRequest, decode_output_batch, encode
from mmserve.transit.sockets import LinkInbox, LinkOutbox
from mmserve.wire import EngineCoreRequest, SamplingParams

pytestmark = pytest.mark.serve


def _long_request(request_id: str) -> EngineCoreRequest:
    sampling = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    return EngineCoreRequest(request_id, [1, 2, 3], None, sampling, None, time.time(), None, None, None)


def test_a_lost_request_or_abort_is_found_by_the_next_number_and_the_callers_requests_are_aborted(builtin_app):
    engine_client = builtin_app.engine_handle()

    async def scenario() -> tuple[list[OutputBatch], int, int]:
        inbox = LinkInbox("127.0.0.1")
        subscription = engine_client.options(stream=True).subscribe.remote("", inbox.address)
        hello = decode_output_batch(await subscription.__anext__())
        link = LinkOutbox(hello.requests_address)
        batches: list[OutputBatch] = []

        async def next_batch() -> OutputBatch:
            batches.append(decode_output_batch(await asyncio.wait_for(inbox.recv(), 10)))
            return batches[-1]

        try:
            link.send(TextRequest("", _long_request("lost-link-a")), encode)
            while not any(o.request_id == "lost-link-a" for b in batches for o in b.outputs):
                await next_batch()  # its answer, then its tokens
            running = (await engine_client.info.remote()).num_in_flight
            link.skip()  # (an abort of it, say, lost on the way)
            link.send(Probe(""), encode)
            while not (await next_batch()).lost:
                pass
            deadline = time.monotonic() + 5
            while (in_flight := (await engine_client.info.remote()).num_in_flight) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return batches, running, in_flight
        finally:
            subscription.cancel()
            link.close()
            inbox.close()

    batches, running, in_flight = asyncio.run(scenario())
    assert running == 1
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))  # its own stream: nothing lost that way
    assert in_flight == 0, "the caller's request still ran in the engine after the loss was found"
    assert msgspec.structs.replace(batches[-1], outputs=[], stream=0, seq=0) == OutputBatch(lost=True)
