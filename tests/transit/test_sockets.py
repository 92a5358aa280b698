"""The ZMQ links (`mmserve.transit.sockets`): `SocketReader`, a PULL socket read by a thread, handed to the loop
and stopped at once by `close`; and the inbox and outbox over it, messages whole and in order."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest
import zmq

import msgspec

from mmserve.transit.sockets import Arrivals, LinkInbox, LinkMessage, LinkOutbox, SocketReader
from tests.support.zmq_ports import assert_bindable_soon


def _bound_pull() -> tuple[zmq.Socket, str]:
    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    return socket, f"tcp://127.0.0.1:{port}"


def _push(address: str) -> zmq.Socket:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(address)
    return push


@contextlib.contextmanager
def _reader_and_sender() -> Iterator[tuple[SocketReader, zmq.Socket]]:
    """A reader on a bound PULL socket and a PUSH socket connected to it; both closed after."""
    socket, address = _bound_pull()
    reader = SocketReader(socket, name="test-reader")
    push = _push(address)
    try:
        yield reader, push
    finally:
        push.close()
        reader.close()


def test_messages_arrive_whole_and_in_order_across_bursts():
    """The thread receives while the loop does something else; the loop then takes every waiting
    message, in order, with no message lost between the thread and the loop."""
    async def run():
        with _reader_and_sender() as (reader, push):
            received = []
            for burst in range(40):
                messages = [f"{burst}-{i}:".encode() + b"x" * (i * 1000) for i in range(burst % 5 + 1)]
                for message in messages:
                    push.send(message)
                if burst % 2:
                    time.sleep(0.005)  # the loop busy: the thread takes them meanwhile
                for _ in messages:
                    received.append(await asyncio.wait_for(reader.recv(), 5))
            return received

    received = asyncio.run(run())
    assert received == [f"{b}-{i}:".encode() + b"x" * (i * 1000) for b in range(40) for i in range(b % 5 + 1)]


def test_a_message_that_only_looks_like_a_stop_is_delivered():
    """Only the reader's own random token stops it; an empty or short frame is a message."""
    async def run():
        with _reader_and_sender() as (reader, push):
            for message in (b"", b"\0" * 16, b"last"):
                push.send(message)
            return [await asyncio.wait_for(reader.recv(), 5) for _ in range(3)]

    assert asyncio.run(run()) == [b"", b"\0" * 16, b"last"]


def test_close_ends_the_thread_unbinds_and_wakes_a_waiting_recv():
    async def run():
        socket, address = _bound_pull()
        reader = SocketReader(socket, name="test-reader")
        waiting = asyncio.ensure_future(reader.recv())
        await asyncio.sleep(0.05)  # the thread runs, blocked in its receive with no timeout
        thread = reader._thread
        assert thread is not None and thread.is_alive()
        started = time.monotonic()
        reader.close()
        took = time.monotonic() - started
        with pytest.raises(zmq.ZMQError):
            await asyncio.wait_for(waiting, 2)
        return address, thread, took

    address, thread, took = asyncio.run(run())
    assert not thread.is_alive() and took < 1
    # The socket was closed when close returned; zmq's I/O thread unbinds it just after.
    assert_bindable_soon(address)


def test_a_silent_reader_does_not_wake_up():
    """Blocked with no timeout: an idle connection costs no periodic work."""
    async def run():
        socket, _ = _bound_pull()
        reader = SocketReader(socket, name="test-reader")
        waiting = asyncio.ensure_future(reader.recv())
        await asyncio.sleep(0.05)
        thread = reader._thread
        assert thread is not None
        native_id = thread.native_id
        before = _voluntary_switches(native_id)
        await asyncio.sleep(0.5)
        after = _voluntary_switches(native_id)
        waiting.cancel()
        reader.close()
        return before, after

    before, after = asyncio.run(run())
    assert after == before


def _voluntary_switches(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


class Blob(LinkMessage, frozen=True):
    data: bytes


def test_messages_arrive_in_order_small_and_large_numbered_in_their_outboxs_stream():
    async def run():
        inbox = LinkInbox("127.0.0.1")
        outbox = LinkOutbox(inbox.address)
        try:
            messages = [b"first", b"x" * 200_000, b"", b"last"]
            for message in messages:
                outbox.send(Blob(message), msgspec.msgpack.encode)
            received = [msgspec.msgpack.decode(await asyncio.wait_for(inbox.recv(), 5), type=Blob) for _ in messages]
            return messages, received, outbox.stream
        finally:
            outbox.close()
            inbox.close()

    sent, received, stream = asyncio.run(run())
    assert [m.data for m in received] == sent
    assert [(m.stream, m.seq) for m in received] == [(stream, 1), (stream, 2), (stream, 3), (stream, 4)]


def _at(stream: int, seq: int) -> LinkMessage:
    return LinkMessage(stream=stream, seq=seq)


def test_arrivals_find_a_number_skipped_in_a_senders_newest_stream_and_only_there():
    arrivals = Arrivals()
    assert [arrivals.lost("a", _at(7, n)) for n in (1, 2, 3)] == [False, False, False]
    assert arrivals.lost("a", _at(7, 5))  # 4 never came
    assert not arrivals.lost("a", _at(7, 6))  # the stream goes on from there
    assert not arrivals.lost("b", _at(7, 1))  # each sender its own
    assert arrivals.lost("c", _at(3, 2))  # a stream first seen after its first message
    assert not arrivals.lost("a", _at(8, 1))  # the sender's new stream (it connected anew) ...
    assert not arrivals.lost("a", _at(7, 9))  # ... after which the old one's late messages show nothing
    assert arrivals.lost("a", _at(8, 3))
    arrivals.forget("a")
    assert arrivals.lost("a", _at(8, 5))  # forgotten: as if first seen


def test_a_message_given_up_is_skipped_and_its_receiver_finds_it_lost():
    async def run():
        inbox = LinkInbox("127.0.0.1")
        outbox = LinkOutbox(inbox.address)
        arrivals = Arrivals()
        try:
            outbox.send(Blob(b"1"), msgspec.msgpack.encode)
            outbox.skip()
            outbox.send(Blob(b"3"), msgspec.msgpack.encode)
            return [arrivals.lost("o", msgspec.msgpack.decode(await asyncio.wait_for(inbox.recv(), 5), type=Blob)) for _ in range(2)]
        finally:
            outbox.close()
            inbox.close()

    assert asyncio.run(run()) == [False, True]


def test_close_stops_the_thread_and_unbinds_the_address():
    async def run():
        inbox = LinkInbox("127.0.0.1")
        outbox = LinkOutbox(inbox.address)
        outbox.send(Blob(b"one"), msgspec.msgpack.encode)
        assert msgspec.msgpack.decode(await asyncio.wait_for(inbox.recv(), 5), type=Blob).data == b"one"  # the thread runs
        thread = inbox._reader._thread
        inbox.close()
        outbox.close()
        return inbox.address, thread.is_alive()

    address, alive = asyncio.run(run())
    assert not alive
    assert_bindable_soon(address)  # the socket closed, zmq's I/O thread unbinds it just after
