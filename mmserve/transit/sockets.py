"""The ZMQ sockets every link is made of: an inbox each side binds, outboxes the other side connects; and how a message lost on a link is found.

A Ray call or stream item costs a few hundred microseconds of CPU on each side; at low concurrency
every engine step is one item per caller, i.e. one per token. A ZMQ message costs tens. So
everything that flows per request or per engine step travels over ZMQ, each way as single-frame
messages from `LinkOutbox`es (PUSH) to one `LinkInbox` (PULL, bound on its node's address): between
an ingress replica and an engine client (`engine_link.py`), and between an engine client and a
preprocessor replica (`preprocessing_link.py`). A Ray call beside each pair of links is its control
channel: it names the inboxes, and its end says the other side is gone.

Nothing is dropped while a connection holds: no high-water mark on either side (the reader reads as
fast as its loop runs; a message waits in memory rather than vanish). A connection that breaks, and
that ZMQ remakes, loses what was on its way, and so does an answer a sender gives up delivering.
Every link finds such a loss the same way: each message carries its outbox's stream (a random
number) and its place there (`LinkMessage`), so the receiver sees a number skipped (`Arrivals`); and
a side that waits for an answer while it has heard nothing for `LINK_PROBE_S` sends a probe, a
numbered message that is answered with a numbered one, so that a loss at the end of a stream is
found too, within two probes. What a side does about a loss is its link's business: what was in
flight between the two fails, and is tried once more where nothing has been generated.

An inbox is read by a thread of its own with blocking receives (`SocketReader`), not through pyzmq's
asyncio socket, whose every message costs a future, an `EVENTS` query and a re-arm of the loop's
reader: a thread blocked in `recv` costs the receive and, per burst, one `call_soon_threadsafe`, and
a loop that lags takes every waiting message at once. The thread owns the
socket from its start (a ZMQ socket is used by one thread) and blocks with no timeout, so a silent
socket costs nothing. `close` stops it at once: the socket is also bound to an `inproc://` address
of its own, where `close` sends a random stop token; the thread, on receiving it, closes the socket
and ends, and `close` waits for that (zmq's I/O thread then unbinds the socket's addresses, within
milliseconds).
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
from collections.abc import Callable, Hashable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

# A side that waits for answers and has heard nothing on the link for this long sends a probe.
LINK_PROBE_S = 5.0
# How long `close` waits for the thread to take the stop token and close the socket.
CLOSE_WAIT_S = 2.0


class SocketReader:
    """Reads `socket` (a bound sync PULL socket, handed over: nobody else may use it) in a thread
    started by the first `recv`, on that call's event loop. Each message is one frame's bytes."""

    def __init__(self, socket: zmq.Socket, *, name: str) -> None:
        self._socket = socket
        self._name = name
        self._stop_token = os.urandom(16)
        self._stop_address = f"inproc://mmserve-stop-{self._stop_token.hex()}"
        socket.bind(self._stop_address)
        self._received: collections.deque[bytes] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        # Set by the thread when a wake-up is on its way to the loop, cleared by the loop when it
        # takes it: one wake-up per burst, however many messages it holds.
        self._wake_pending = False
        self._thread: threading.Thread | None = None
        self.closed = False

    async def recv(self) -> bytes:
        """The next message, in arrival order (waits for one)."""
        if self._thread is None:
            self._start()
        while not self._received:
            if self.closed:
                raise zmq.ZMQError(zmq.ENOTSOCK, "the socket reader is closed")
            assert self._loop is not None
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._received.popleft()

    def close(self) -> None:
        """Stop the thread and close the socket (closed when this returns; zmq unbinds its addresses
        just after). Idempotent; called on the loop's thread."""
        if self.closed:
            return
        self.closed = True
        thread = self._thread
        if thread is None:
            self._socket.close(linger=0)
        else:
            stop = self._socket.context.socket(zmq.PUSH)
            try:
                stop.connect(self._stop_address)
                stop.send(self._stop_token)
                thread.join(CLOSE_WAIT_S)
            finally:
                stop.close(linger=0)
        self._wake()  # a `recv` waiting on the loop raises instead of waiting forever

    def _start(self) -> None:
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "the socket reader is closed")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._read, name=self._name, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        socket, token, loop = self._socket, self._stop_token, self._loop
        assert loop is not None
        try:
            while True:
                message = socket.recv()
                if message == token:
                    return
                self._received.append(message)
                if not self._wake_pending:
                    self._wake_pending = True
                    try:
                        loop.call_soon_threadsafe(self._wake)
                    except RuntimeError:  # the loop is closed: nobody reads any more
                        return
        except zmq.ZMQError:  # the context was terminated under us
            return
        finally:
            socket.close(linger=0)

    def _wake(self) -> None:
        self._wake_pending = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class LinkInbox:
    """The receiving end: bound once, for its owner's life; every sender connects to it.
    Read on one event loop (the first `recv`'s)."""

    def __init__(self, host: str, *, name: str = "link-inbox") -> None:
        # A sync socket on the asyncio context's own (no second zmq I/O thread in the process).
        socket = zmq.Context.shadow(zmq.asyncio.Context.instance().underlying).socket(zmq.PULL)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        port = socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._reader = SocketReader(socket, name=name)

    async def recv(self) -> bytes:
        """The next message, in arrival order (waits for one)."""
        return await self._reader.recv()

    def close(self) -> None:
        """Stop reading and close the socket, which zmq then unbinds."""
        self._reader.close()


class LinkMessage(msgspec.Struct, frozen=True, kw_only=True):
    """What every message on a link carries: the stream of the outbox that sent it (a random number)
    and its place there, from 1 (`LinkOutbox.send`)."""

    stream: int = 0
    seq: int = 0


class Arrivals:
    """A receiver's record of the streams it reads, by sender: whether a message shows that one
    before it was lost. The first message seen of a stream must be its first; each stream replaces
    its sender's earlier ones (a new outbox: the sender connected anew), whose late messages show nothing."""

    def __init__(self, streams_per_sender: int = 4) -> None:
        self._streams_per_sender = streams_per_sender
        self._last: dict[Hashable, collections.OrderedDict[int, int]] = {}

    def lost(self, sender: Hashable, message: LinkMessage) -> bool:
        streams = self._last.setdefault(sender, collections.OrderedDict())
        last = streams.get(message.stream)
        if last is None:
            streams[message.stream] = message.seq
            if len(streams) > self._streams_per_sender:
                streams.popitem(last=False)
            return message.seq != 1
        streams[message.stream] = max(last, message.seq)
        return message.seq > last + 1 and message.stream == next(reversed(streams))

    def forget(self, sender: Hashable) -> None:
        self._last.pop(sender, None)


class LinkOutbox:
    """A sending end, connected to one inbox: a plain socket (pyzmq's asyncio one would watch its
    descriptor on the loop and handle its every signal, for sends that never wait). Its messages are
    numbered in a stream of its own (`LinkMessage`)."""

    def __init__(self, address: str, ctx: zmq.Context | None = None, *, connected_only: bool = False) -> None:
        # zmq.asyncio's context by default: the one zmq I/O thread the process's other sockets use.
        self._socket = zmq.Socket(ctx or zmq.asyncio.Context.instance(), zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        if connected_only:
            # Sends raise `zmq.Again` while the inbox is not connected (its process died) instead of
            # queueing for it: what would wait for a peer that never comes back is never kept.
            self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.connect(address)
        self.stream = int.from_bytes(os.urandom(6), "big")
        self.sent = 0

    def send(self, message: LinkMessage, encode: Callable[[Any], bytes]) -> None:
        """Number `message` as the next of this outbox's stream, encode it and hand it to zmq now (it
        never waits: no high-water mark, and the connection's pipe exists from `connect` on, so zmq
        queues what the inbox has not taken yet). `connected_only`: raises `zmq.Again` while the inbox
        is not connected, the number unused."""
        data = encode(msgspec.structs.replace(message, stream=self.stream, seq=self.sent + 1))
        self._socket.send(data, zmq.NOBLOCK, copy=len(data) < 65536)
        self.sent += 1

    def skip(self) -> None:
        """A message will never be sent after all (given up undelivered): its number is skipped, so
        that the receiver finds it lost."""
        self.sent += 1

    @property
    def closed(self) -> bool:
        return self._socket.closed

    def close(self) -> None:
        self._socket.close(linger=0)
