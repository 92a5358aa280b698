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
"""

from __future__ import annotations

import zmq
import zmq.asyncio


class OutputInbox:
    """The caller's end: bound once, for the caller's life; every engine client connects to it."""

    def __init__(self, host: str, ctx: zmq.asyncio.Context | None = None) -> None:
        self._socket = (ctx or zmq.asyncio.Context.instance()).socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"

    async def recv(self) -> bytes:
        return await self._socket.recv(copy=True)

    def close(self) -> None:
        self._socket.close(linger=0)


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
