"""The ZMQ link from an engine client to a caller: messages arrive whole and in order, sent before or after the inbox reads."""

from __future__ import annotations

import asyncio

from mmserve.engine.output_link import OutputInbox, OutputOutbox

from tests.support.zmq_ports import assert_bindable_soon


def test_messages_arrive_in_order_small_and_large():
    async def run():
        inbox = OutputInbox("127.0.0.1")
        outbox = OutputOutbox(inbox.address)
        try:
            messages = [b"first", b"x" * 200_000, b"", b"last"]
            for message in messages:
                await outbox.send(message)
            return messages, [await asyncio.wait_for(inbox.recv(), 5) for _ in messages]
        finally:
            outbox.close()
            inbox.close()

    sent, received = asyncio.run(run())
    assert received == sent


def test_close_stops_the_thread_and_unbinds_the_address():
    async def run():
        inbox = OutputInbox("127.0.0.1")
        outbox = OutputOutbox(inbox.address)
        await outbox.send(b"one")
        assert await asyncio.wait_for(inbox.recv(), 5) == b"one"  # the thread runs
        thread = inbox._reader._thread
        inbox.close()
        outbox.close()
        return inbox.address, thread.is_alive()

    address, alive = asyncio.run(run())
    assert not alive
    assert_bindable_soon(address)  # the socket closed, zmq's I/O thread unbinds it just after
