"""The ZMQ link from an engine client to a caller: messages arrive whole and in order, sent before or after the inbox reads."""

from __future__ import annotations

import asyncio
import time

import zmq

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


def test_a_burst_sent_while_the_loop_is_busy_is_taken_whole_and_in_order():
    """The inbox's thread receives while the caller's loop does something else; the loop then takes
    every waiting message, in order, with no message lost between the thread and the loop."""
    async def run():
        inbox = OutputInbox("127.0.0.1")
        outbox = OutputOutbox(inbox.address)
        try:
            received = []
            for burst in range(50):
                messages = [f"{burst}-{i}".encode() for i in range(burst % 7 + 1)]
                for message in messages:
                    await outbox.send(message)
                if burst % 2:
                    time.sleep(0.005)  # the loop busy: the thread takes them meanwhile
                for _ in messages:
                    received.append(await asyncio.wait_for(inbox.recv(), 5))
            return received
        finally:
            outbox.close()
            inbox.close()

    received = asyncio.run(run())
    assert received == [f"{burst}-{i}".encode() for burst in range(50) for i in range(burst % 7 + 1)]


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
