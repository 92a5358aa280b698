"""The front-end of one vLLM engine: request lifecycle over the EngineCore wire.

Lifecycle: `start()` binds the sockets and completes the handshake; `add()` sends an ADD and
hands the engine's outputs for that request to its sink until it finishes (a sink may merge the
outputs of many requests for one consumer: no task or queue per request here); `abort()` sends
an ABORT; `generate()` is the one-request form, an iterator whose early exit aborts, so no
request outlives its consumer; `close()` fails what is open and releases the sockets.

An engine is declared dead, and every open request fails with `EngineDeadError`, when it
says so (`ENGINE_CORE_DEAD`), when its TCP connection drops (a killed process), or when it
leaves a cheap utility call unanswered for `health_check_timeout_s` (a hung process; see
`liveness.py`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq

from ..wire import EngineCoreOutput, EngineCoreRequest, EngineDeadMessage, OutputDecoder, ReadyResponse, RequestEncoder, SchedulerStats
from .errors import EngineDeadError, EngineError, EngineNotReadyError
from .frame_diagnostics import FrameTrace
from .guard import InvalidRequestError, admit
from .liveness import probe_health, watch_disconnect
from .outputs import OutputSink, RequestStream
from .config import EngineClientConfig
from .mm_adds import EngineAdds, Refill
from .mm_cache import SenderCacheMirror
from .transport import EngineTransport
from .utility_calls import UtilityCalls

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"
    CLOSED = "closed"


class _InFlight:
    """A request the engine holds: its sink, and the request itself (resent on a cache miss; with
    `refill`, if it went with items by hash only, from there)."""

    __slots__ = ("request", "sink", "refill", "resent")

    def __init__(self, request: EngineCoreRequest, sink: OutputSink, refill: Refill | None) -> None:
        self.request = request
        self.sink = sink
        self.refill = refill
        self.resent = False


class EngineClient:
    def __init__(self, config: EngineClientConfig) -> None:
        self.config = config
        self.state = EngineState.STARTING
        self.ready: ReadyResponse | None = None
        self.death_reason: str | None = None
        self.scheduler_stats: SchedulerStats | None = None
        self._transport: EngineTransport | None = None
        self._encoder = RequestEncoder()
        self._decoder = OutputDecoder()
        self._requests: dict[str, _InFlight] = {}
        self._utility_calls = UtilityCalls(self._send)
        self._tasks: list[asyncio.Task[None]] = []
        self._ready_event = asyncio.Event()
        # Set once the engine is declared dead (or its handshake failed): a launcher restarts it.
        self.dead_event = asyncio.Event()
        # Dead because it stopped answering (its process may still exist), not because it exited.
        self.hung = False
        self._start_error: BaseException | None = None
        self.handshake_address: str | None = None
        self.bytes_sent = 0
        self.frame_traces: deque[FrameTrace] = deque(maxlen=max(config.trace_frames, 1))
        self.input_address: str | None = None
        self.output_address: str | None = None
        # ADDs, and the multimodal items in them (by hash where the engine holds them).
        self.adds = EngineAdds(self._send, in_flight=self._requests.__contains__)
        self._release_task: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- lifecycle

    def bind(self) -> None:
        """Bind the sockets now, so an engine can connect before `start()` runs."""
        if self._transport is None:
            self._transport = EngineTransport(self.config.addresses)
            if self.config.trace_frames:
                self._transport.frame_observer = lambda array, frame: self.frame_traces.append(FrameTrace.of(array, frame))
            self.handshake_address = self._transport.handshake_address
            self.input_address = self._transport.input_address
            self.output_address = self._transport.output_address

    async def start(self) -> ReadyResponse:
        """Bind, wait for the engine's handshake, then serve. Raises if the engine is unusable."""
        self.bind()
        assert self._transport is not None
        try:
            self.ready = await self._transport.handshake(self.config.handshake_timeout_s)
        except BaseException as exc:
            self._start_error = exc
            self.state = EngineState.DEAD
            self.death_reason = str(exc)
            self._ready_event.set()
            self.dead_event.set()
            raise
        # The handshake port is not needed any more: release it, so that an engine restarted
        # on it (after this one dies) waits for our replacement instead of saying HELLO to a
        # socket nobody reads (a DEALER does not resend it on reconnect).
        self._transport.close_handshake()
        self.adds.mirror = SenderCacheMirror.for_engine(self.config.mm_cache, self.ready)
        # Watch for disconnects before anything else can go wrong.
        monitor = self._transport.watch_disconnects()
        config = self.config
        self._transport.read_outputs(self._on_output)
        self._tasks = [
            asyncio.create_task(watch_disconnect(monitor, self._declare_dead), name="engine-monitor"),
            asyncio.create_task(probe_health(
                self.call_utility, lambda: self.state is EngineState.READY, self._declare_hung,
                self._transport.last_heard, config.health_check_interval_s, config.health_check_timeout_s,
            ), name="engine-health"),
        ]
        self.state = EngineState.READY
        self._ready_event.set()
        logger.info(
            "engine ready: vLLM %s, max_model_len=%d, dtype=%s, max_num_seqs=%d",
            self.ready.vllm_version, self.ready.max_model_len, self.ready.dtype, self.ready.max_num_seqs,
        )
        return self.ready

    async def wait_ready(self, timeout_s: float | None = None) -> ReadyResponse:
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        except TimeoutError:
            raise EngineNotReadyError("the engine is still starting") from None
        self._raise_if_unusable()
        assert self.ready is not None
        return self.ready

    async def close(self, reason: str = "engine client closed") -> None:
        """Fail every request in flight with `reason` and release the sockets."""
        if self.state is EngineState.CLOSED:
            return
        self._fail_everything(EngineDeadError(reason))
        self.state = EngineState.CLOSED
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._release_task is not None:
            await asyncio.gather(self._release_task, return_exceptions=True)
        if self._transport is not None:
            self._transport.close()

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    # ----------------------------------------------------------------- requests

    async def add(self, request: EngineCoreRequest, sink: OutputSink, refill: Refill | None = None) -> None:
        """Send `request`; its outputs go to `sink` until one is finished, or `sink.fail` is called
        (engine dead). Raises if the request cannot be sent (then nothing reaches the sink).
        `refill`: for a request that carries items by hash only, see `EngineAdds`."""
        self._raise_if_unusable()
        assert self.ready is not None
        request = admit(request, self.ready.max_model_len)
        request_id = request.request_id
        if request_id in self._requests:
            # vLLM asserts on duplicate ids inside the engine, which kills it.
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        entry = self._requests[request_id] = _InFlight(request, sink, refill)
        try:
            entry.request = await self.adds.send(request, refill=refill)
        except BaseException:
            self._requests.pop(request_id, None)
            raise

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[list[EngineCoreOutput]]:
        """Send `request` and yield its outputs (batched as they arrived) until it finishes.

        Closing or cancelling the iteration before the engine finished aborts the request.
        """
        stream = RequestStream()
        await self.add(request, stream)
        try:
            while not stream.finished:
                yield await stream.next_batch()
        finally:
            if not stream.finished:
                await self.abort_quietly([request.request_id])

    async def abort(self, request_ids: list[str]) -> None:
        """Stop these requests in the engine; their sinks get nothing more."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)
        await self._send(self._encoder.encode_abort(request_ids))

    async def abort_quietly(self, request_ids: list[str]) -> None:
        """`abort`, for cleanup paths: an engine that is dying or dead drops its requests anyway."""
        if self.state is not EngineState.READY:
            for request_id in request_ids:
                self._requests.pop(request_id, None)
            return
        try:
            await self.abort(request_ids)
        except Exception as exc:
            logger.debug("abort of %s failed: %s", request_ids, exc)

    async def call_utility(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Call an EngineCore method by name (vLLM's UTILITY message) and return its result."""
        self._raise_if_unusable()
        return await self._utility_calls.call(method, args, timeout_s)

    # ----------------------------------------------------------------- internals

    def _raise_if_unusable(self) -> None:
        if self.state is EngineState.READY:
            return
        if self.state is EngineState.STARTING:
            raise EngineNotReadyError("the engine is still starting")
        raise EngineDeadError(self.death_reason or f"engine is {self.state.value}")

    async def _send(self, frames: list) -> None:
        assert self._transport is not None
        self.bytes_sent += sum(len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes for f in frames)
        try:
            await self._transport.send(frames)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self._declare_dead("engine is not connected to the input socket")
                raise EngineDeadError(self.death_reason) from None
            raise

    def _on_output(self, frames: list[bytes]) -> None:
        """One message from the engine's output socket (`EngineTransport.read_outputs`)."""
        if self.state is not EngineState.READY:
            return  # (declared dead: its requests failed already)
        try:
            outputs = self._decoder.decode(frames)
        except EngineDeadMessage:
            self._declare_dead("engine reported ENGINE_CORE_DEAD")
            return
        except (msgspec.DecodeError, ValueError) as exc:
            logger.error("undecodable engine output dropped: %s", exc)
            return
        if outputs.scheduler_stats is not None:
            self.scheduler_stats = outputs.scheduler_stats
        if outputs.utility_output is not None:
            self._utility_calls.answered(outputs.utility_output)
        for output in outputs.outputs:
            entry = self._requests.get(output.request_id)
            if entry is None:
                # Late output of an aborted or finished request, or someone else's id.
                continue
            if output.finished:
                missing = output.mm_cache_miss_hashes
                if not entry.resent and self.adds.resend_on_cache_miss(entry.request, missing, self._fail, entry.refill):
                    entry.resent = True  # once: the caller sees a normal answer
                    continue
                # Later outputs for this id (there should be none) are dropped.
                del self._requests[output.request_id]
            entry.sink.put(output)

    def _fail(self, request_id: str, error: EngineError) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            entry.sink.fail(request_id, error)

    def _declare_hung(self, reason: str) -> None:
        self.hung = True  # its process may still be there, answering nobody
        self._declare_dead(reason)

    def _declare_dead(self, reason: str) -> None:
        if self.state is not EngineState.READY:
            return
        # A warning, once, with the reason: the requests it fails are each logged by the ingress
        # (one INFO line per request), and Serve replaces or the launcher restarts the engine.
        logger.warning("engine declared dead: %s (%d requests in flight failed)", reason, self.num_in_flight)
        self.state = EngineState.DEAD
        self.death_reason = reason
        self.dead_event.set()
        self._fail_everything(EngineDeadError(reason))
        # Release the sockets at once: a replacement (on the same fixed addresses) can bind
        # them without waiting for this process to go away, and a hung engine that wakes up
        # finds nobody to talk to instead of a front-end that gave up on it.
        self._release_task = asyncio.get_running_loop().create_task(self._release_sockets(), name="engine-release")

    async def _release_sockets(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current and not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._transport is not None:
            self._transport.close()
        logger.info("engine sockets released (%s)", self.death_reason)

    def _fail_everything(self, error: EngineError) -> None:
        requests, self._requests = self._requests, {}
        for request_id, entry in requests.items():
            entry.sink.fail(request_id, error)
        self._utility_calls.fail_all(error)

