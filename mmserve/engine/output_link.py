"""The ZMQ link that carries an engine client's output batches to one caller (an ingress replica).

A Ray stream item costs a few hundred microseconds of CPU on each side; at low concurrency every
engine step is one item per caller, i.e. one per token. A ZMQ message costs tens. So the batches
travel over ZMQ: the caller binds an `OutputInbox` (a PULL socket on its node's address) and names
it when it subscribes; the engine client connects an `OutputOutbox` (PUSH) to it. The Ray
subscription stays open beside the link as its control channel: it tells the caller which
engine-client replica is sending, and its end tells the caller that replica is gone.

Neither side knows what the bytes hold (`mmserve.protocol.OutputBatch`). Nothing is dropped: no
high-water mark on either side (the caller reads as fast as its loop runs; a batch waits in
memory rather than vanish).

The inbox is read by a thread of its own with blocking receives, not through pyzmq's asyncio
socket, which costs a future, an EVENTS query and a reader re-arm per message: 165 µs of CPU per
message against 89 for the thread and its hand-over, at one message every 2 ms (an engine step at
one stream; `bench/inbox_bench.py`). The thread hands what it received to the event loop in one
wake-up per burst: a caller whose loop lags takes every waiting batch at once.
"""

from __future__ import annotations

import asyncio
import collections
import threading

import zmq
import zmq.asyncio

# How often the inbox's thread looks up from a silent socket to see whether it was closed.
INBOX_POLL_MS = 100


class OutputInbox:
    """The caller's end: bound once, for the caller's life; every engine client connects to it.
    Created on the caller's event loop, which `recv` serves."""

    def __init__(self, host: str) -> None:
        # A plain (blocking) socket, used by the reading thread only once it runs.
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVTIMEO, INBOX_POLL_MS)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._loop = asyncio.get_running_loop()
        self._received: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        # Set by the thread when a wake-up is on its way to the loop, cleared by the loop when it
        # takes it: one wake-up per burst, however many messages it holds.
        self._wake_pending = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, name="output-inbox", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        socket = self._socket
        try:
            while not self._closed.is_set():
                try:
                    message = socket.recv(copy=True)
                except zmq.Again:
                    continue
                self._received.append(message)
                if not self._wake_pending:
                    self._wake_pending = True
                    try:
                        self._loop.call_soon_threadsafe(self._wake)
                    except RuntimeError:  # the loop is closed: nobody reads any more
                        return
        finally:
            socket.close(linger=0)

    def _wake(self) -> None:
        self._wake_pending = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def recv(self) -> bytes:
        """The next message, in arrival order (waits for one)."""
        while not self._received:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._received.popleft()

    def close(self) -> None:
        """Stop reading; the thread closes the socket (a socket is used by one thread) within
        `INBOX_POLL_MS`, unbinding the address."""
        self._closed.set()


class OutputOutbox:
    """The engine client's end for one caller."""

    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None) -> None:
        self._socket = (ctx or zmq.asyncio.Context.instance()).socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)

    async def send(self, message: bytes) -> None:
        await self._socket.send(message, copy=len(message) < 65536)

    def close(self) -> None:
        self._socket.close(linger=0)
