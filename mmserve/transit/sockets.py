"""The ZMQ links between an engine client and its callers (ingress replicas): an inbox each side binds, outboxes the other side connects.

A Ray call or stream item costs a few hundred microseconds of CPU on each side; at low concurrency
every engine step is one item per caller, i.e. one per token. A ZMQ message costs tens. So what
flows per request or per engine step travels over ZMQ, each way as single-frame messages from
`LinkOutbox`es (PUSH) to one `LinkInbox` (PULL, bound on its node's address):
- outputs: each caller binds an inbox and names it when it subscribes to an engine client, which
  sends it `mmserve.transit.engine_link.OutputBatch`es; the Ray subscription stays open beside the link as
  its control channel (it names the engine-client replica sending, and its end says that replica
  is gone);
- requests: each engine client binds an inbox too, named in the subscription's first batch, where
  its callers send `mmserve.transit.engine_link.LinkRequest`s (text requests and aborts); the answers come back
  in the output batches.

Neither side knows what the bytes hold. Nothing is dropped: no high-water mark on either side (the
reader reads as fast as its loop runs; a message waits in memory rather than vanish).

An inbox is read by a thread of its own with blocking receives (`SocketReader`), not through pyzmq's
asyncio socket, whose every message costs a future, an `EVENTS` query and a re-arm of the loop's
reader: a thread blocked in `recv` costs the receive and, per burst, one `call_soon_threadsafe`
(`bench/inbox_bench.py`: 89 µs of CPU per message against 165 at one message every 2 ms, an engine
step at one stream), and a loop that lags takes every waiting message at once. The thread owns the
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

import zmq
import zmq.asyncio

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


class LinkOutbox:
    """A sending end, connected to one inbox: a plain socket (pyzmq's asyncio one would watch its
    descriptor on the loop and handle its every signal, for sends that never wait)."""

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

    def send_nowait(self, message: bytes) -> None:
        """Hand `message` to zmq now (it never waits: no high-water mark, and the connection's pipe
        exists from `connect` on, so zmq queues what the inbox has not taken yet)."""
        self._socket.send(message, zmq.NOBLOCK, copy=len(message) < 65536)

    @property
    def closed(self) -> bool:
        return self._socket.closed

    def close(self) -> None:
        self._socket.close(linger=0)
