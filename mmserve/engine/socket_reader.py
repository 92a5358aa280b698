"""A ZMQ PULL socket read by a thread of its own, handed to an asyncio loop in one wake-up per burst
(an ingress replica's output inbox).

pyzmq's asyncio socket costs, per message, a future, an `EVENTS` query and a re-arm of the loop's
reader; a thread blocked in `recv` costs the receive and, per burst, one `call_soon_threadsafe`
(`bench/inbox_bench.py`: 165 µs of CPU per message against 89 at one message every 2 ms, an engine
step at one stream). A loop that lags takes every waiting message at once.

The thread owns the socket from its start (a ZMQ socket is used by one thread) and blocks with no
timeout, so a silent socket costs nothing. `close` stops it at once: the socket is also bound to an
`inproc://` address of its own, where `close` sends a random stop token; the thread, on receiving
it, closes the socket and ends, and `close` waits for that (zmq's I/O thread then unbinds the
socket's addresses, within milliseconds).
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading

import zmq

# How long `close` waits for the thread to take the stop token and close the socket.
CLOSE_WAIT_S = 2.0


class SocketReader:
    """Reads `socket` (a bound sync PULL socket of single-frame messages, handed over: nobody else
    may use it) in a thread started by the first `recv`, on that call's event loop."""

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
