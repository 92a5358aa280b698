"""ZMQ sockets between one engine client and one engine, and the startup handshake.

The front-end binds all three sockets and the engine connects to them (vLLM's headless
mode): a ROUTER for the handshake, a ROUTER for requests (the engine's DEALER identity is
its data-parallel rank) and a PULL for outputs. Nothing here knows about requests; see
`client.py` for their lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np
import zmq
import zmq.asyncio

from ..wire import SUPPORTED_VLLM_VERSIONS, EngineZmqAddresses, HandshakeInit, ReadyResponse
from ..wire.codec import Frame, decode_ready_response, decode_status, encode_handshake_init
from .errors import EngineNotReadyError, EngineVersionError

logger = logging.getLogger(__name__)

# Below this, copying into a ZMQ message is cheaper than tracking a borrowed buffer
# (pyzmq's own copy threshold).
ZERO_COPY_MIN_BYTES = 64 * 1024


@dataclass(frozen=True)
class EngineAddresses:
    """Where this front-end listens for one engine.

    `handshake` is what the engine is started with (`--data-parallel-address HOST
    --data-parallel-rpc-port PORT`). `inputs`/`outputs` default to random ports on the
    handshake host; fix them when an engine must be able to reconnect after a gateway
    restart without a new handshake.
    """

    handshake: str
    inputs: str | None = None
    outputs: str | None = None

    @property
    def host(self) -> str:
        parts = urlsplit(self.handshake)
        if parts.scheme != "tcp" or parts.hostname is None:
            raise ValueError(f"handshake address must be tcp://HOST:PORT, got {self.handshake!r}")
        return parts.hostname


def _bind(sock: zmq.Socket, address: str | None, host: str) -> str:
    if address is None or address.endswith(":0"):
        bind_host = host if address is None else urlsplit(address).hostname
        port = sock.bind_to_random_port(f"tcp://{bind_host}")
        return f"tcp://{bind_host}:{port}"
    sock.bind(address)
    return address


class EngineTransport:
    """Owns the three sockets of one engine connection."""

    def __init__(self, addresses: EngineAddresses, ctx: zmq.asyncio.Context | None = None) -> None:
        self.addresses = addresses
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._handshake = self._ctx.socket(zmq.ROUTER)
        self._inputs = self._ctx.socket(zmq.ROUTER)
        # Fail loudly (EHOSTUNREACH) instead of dropping a request when the engine is gone.
        self._inputs.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A plain socket read by a reader on its descriptor (`read_outputs`), not pyzmq's asyncio
        # socket: its futures and event handling were a third of the relay's loop time per step.
        self._outputs = zmq.Socket(self._ctx, zmq.PULL)
        for sock in (self._handshake, self._inputs, self._outputs):
            sock.setsockopt(zmq.LINGER, 0)
        # Outputs must never be dropped: no high-water mark on the receiving side.
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        host = addresses.host
        self.handshake_address = _bind(self._handshake, addresses.handshake, host)
        self.input_address = _bind(self._inputs, addresses.inputs, host)
        self.output_address = _bind(self._outputs, addresses.outputs, host)
        self.engine_identity: bytes | None = None
        # Called with (array, zmq frame) for every zero-copy frame sent (tests, diagnostics).
        self.frame_observer: Callable[[np.ndarray, zmq.Frame], None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._last_output_at = 0.0
        # The event loop whose reader drains the output socket (`read_outputs`), and how to wake it
        # when a message waits although the descriptor said nothing (see `last_heard`).
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self._wake_reader: Callable[[], None] | None = None
        self.closed = False

    async def handshake(self, timeout_s: float) -> ReadyResponse:
        """Answer the engine's HELLO, then wait for its ready response and READY.

        Raises EngineNotReadyError on timeout and EngineVersionError for an unsupported engine.
        """
        try:
            return await asyncio.wait_for(self._handshake_steps(), timeout_s)
        except TimeoutError:
            raise EngineNotReadyError(
                f"no engine completed the handshake on {self.handshake_address} within {timeout_s:.0f} s"
            ) from None

    async def _handshake_steps(self) -> ReadyResponse:
        identity, hello_bytes = await self._handshake.recv_multipart()
        hello = decode_status(hello_bytes)
        if hello.status != "HELLO":
            raise EngineNotReadyError(f"expected HELLO from the engine, got {hello.status!r}")
        init = HandshakeInit(
            addresses=EngineZmqAddresses(inputs=[self.input_address], outputs=[self.output_address])
        )
        await self._handshake.send_multipart([identity, encode_handshake_init(init)])
        logger.info("engine %s said HELLO; sent inputs=%s outputs=%s", identity.hex(), self.input_address, self.output_address)

        # The first input-socket message is the ready response; it also teaches our ROUTER
        # the engine's identity, without which we could not address requests to it.
        engine_identity, ready_bytes = await self._inputs.recv_multipart()
        ready = decode_ready_response(ready_bytes)
        if not ready.vllm_version.startswith(SUPPORTED_VLLM_VERSIONS):
            raise EngineVersionError(
                f"engine runs vLLM {ready.vllm_version}; this gateway mirrors the wire format of "
                f"vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM_VERSIONS)} only"
            )
        self.engine_identity = engine_identity
        _, ready_msg = await self._handshake.recv_multipart()
        status = decode_status(ready_msg)
        if status.status != "READY":
            raise EngineNotReadyError(f"expected READY from the engine, got {status.status!r}")
        return ready

    def watch_disconnects(self) -> zmq.asyncio.Socket:
        """A monitor socket reporting the engine's TCP connection events on the input socket.

        A killed engine closes its connections at once, which is how a crash is noticed in
        milliseconds rather than after a health-check timeout.
        """
        if self._monitor is None:
            self._monitor = self._inputs.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
        return self._monitor

    async def send(self, frames: list[Frame]) -> None:
        assert self.engine_identity is not None, "send before handshake"
        parts: list[bytes | memoryview | zmq.Frame] = [self.engine_identity]
        for frame in frames:
            if isinstance(frame, np.ndarray) and frame.nbytes >= ZERO_COPY_MIN_BYTES:
                # By reference: the frame points at the array's memory (for images, the Ray
                # object store) and holds the array alive until libzmq has sent it.
                zframe = zmq.Frame(frame, copy=False)
                if self.frame_observer is not None:
                    self.frame_observer(frame, zframe)
                parts.append(zframe)
            else:
                parts.append(frame)
        await self._inputs.send_multipart(parts, copy=False)

    def read_outputs(self, on_output: Callable[[list[bytes]], None]) -> None:
        """From now until `close`, hand each message the engine sends to `on_output`, in order, on
        this event loop, as it arrives: a reader on the socket's descriptor drains the socket, with
        no future or task per message. `on_output` must not raise (what it raises is logged)."""
        loop = asyncio.get_running_loop()
        self._reader_loop = loop
        self._wake_reader = lambda: loop.call_soon(self._drain_outputs, on_output)
        loop.add_reader(self._outputs.FD, self._drain_outputs, on_output)
        loop.call_soon(self._drain_outputs, on_output)  # (what arrived before)

    def _drain_outputs(self, on_output: Callable[[list[bytes]], None]) -> None:
        # zmq's descriptor signals a change, not a message: read until none is left, or it stays silent.
        while not self.closed:
            try:
                frames = self._outputs.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_output_at = time.monotonic()
            try:
                on_output(frames)
            except Exception:
                logger.exception("engine output handler failed")

    def last_heard(self) -> float:
        """When the engine was last heard from (monotonic), the proof of life of a busy engine: when an
        output was last read, or now if one waits unread. zmq's I/O thread receives while this
        process's event loop is stalled (a loaded gateway), and a stalled loop must not take the
        engine's outputs for silence."""
        if self._outputs.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            # Reading EVENTS consumes the descriptor's signal: the reader must be woken by hand.
            if self._wake_reader is not None:
                self._wake_reader()
            return time.monotonic()
        return self._last_output_at

    def close_handshake(self) -> None:
        """Unbind the handshake port (the handshake cannot be redone on this connection)."""
        if not self._handshake.closed:
            self._handshake.close(linger=0)

    def close(self) -> None:
        """Close every socket, unbinding all three addresses. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._reader_loop is not None and not self._reader_loop.is_closed() and not self._outputs.closed:
            self._reader_loop.remove_reader(self._outputs.FD)
        if self._monitor is not None:
            self._inputs.disable_monitor()
            self._monitor.close(linger=0)
        for sock in (self._handshake, self._inputs, self._outputs):
            if not sock.closed:
                sock.close(linger=0)
