"""The ZMQ link from an engine client to a caller: messages arrive whole and in order, sent before or after the inbox reads."""

from __future__ import annotations

import asyncio
import time

import zmq

from mmserve.engine.output_link import INBOX_POLL_MS, OutputInbox, OutputOutbox


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
        thread = inbox._thread
        inbox.close()
        thread.join(INBOX_POLL_MS / 1000 * 5)
        return inbox.address, thread.is_alive()

    address, alive = asyncio.run(run())
    assert not alive
    # Unbound (zmq's I/O thread does it just after the close): the port can be bound again.
    sock = zmq.Context.instance().socket(zmq.PULL)
    try:
        for attempt in range(20):
            try:
                sock.bind(address)
                break
            except zmq.ZMQError:
                if attempt == 19:
                    raise
                time.sleep(0.05)
    finally:
        sock.close(linger=0)
