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

The inbox is read by a thread of its own with blocking receives (`socket_reader.SocketReader`), not
through pyzmq's asyncio socket: 89 µs of CPU per message against 165 at one message every 2 ms (an
engine step at one stream; `bench/inbox_bench.py`), and a loop that lags takes every waiting batch
at once.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from .socket_reader import SocketReader


class OutputInbox:
    """The caller's end: bound once, for the caller's life; every engine client connects to it.
    Read on one event loop (the first `recv`'s)."""

    def __init__(self, host: str) -> None:
        # A sync socket on the asyncio context's own (no second zmq I/O thread in the process).
        socket = zmq.Context.shadow(zmq.asyncio.Context.instance().underlying).socket(zmq.PULL)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        port = socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._reader = SocketReader(socket, name="output-inbox")

    async def recv(self) -> bytes:
        """The next message, in arrival order (waits for one)."""
        return await self._reader.recv()

    def close(self) -> None:
        """Stop reading and close the socket, which zmq then unbinds."""
        self._reader.close()


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
