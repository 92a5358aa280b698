"""The built-in engine's process loop: a deterministic stand-in for `vllm serve --headless` on the same ZMQ wire.

It is NOT a model. It plays a vLLM 0.32 EngineCore on the same ZMQ wire so that the gateway
runs end to end on a laptop without a GPU or vLLM:

- handshake (`handshake.py`): as a headless vLLM engine, DEALER → the front-end's ROUTER.
- ADD queues a request, ABORT drops requests silently (vLLM sends nothing for client aborts),
  UTILITY answers `is_sleeping`, `has_work`, `get_supported_tasks`, ... .
- while there is work, steps follow one another, each as long as a GPU's would be for its batch
  (`step_time.py`); at a step's end every request of its batch gets one token, and all of them
  travel in one `EngineCoreOutputs` with scheduler stats.
- per request it records wall times for benchmarks (`timings.py`, the `get_request_timings` utility).

Token rule (deterministic): a PRNG keyed by the prompt token ids and multimodal identifiers
(plus the seed when one is given; greedy requests ignore it; sampled requests without a seed
use a random key) draws readable words, mostly from a fixed word list and partly from the
prompt's own words, and the words are tokenized with the model directory's tokenizer. For each
multimodal item the answer starts with a proof line computed from what arrived, e.g.
`[image 1: grid 1x16x20, 320 patches uint8, sha256 3fa4c0ffee123456]`. The same PRNG picks a
natural length of 8–40 tokens after the proof lines; then the request's EOS
(`_eos_token_id`) is emitted. Stop rules follow vLLM 0.32's `check_stop`: EOS → STOP,
a `stop_token_ids` member → STOP with stop_reason, then max_tokens / max_model_len → LENGTH
(`scheduler.py`). The model stand-in is `model.py`, the multimodal checks `multimodal_input.py`;
this module holds the ZMQ loop that ties them together.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from ..wire.engine_core import ENGINE_CORE_DEAD, EngineCoreOutput, EngineCoreOutputs, FinishReason, RequestType, UtilityOutput
from .fake_model import ModelInfo, new_generation
from .handshake import VLLM_VERSION, handshake, ready_response
from .multimodal_input import MultimodalError, ProofLines
from .scheduler import Scheduler, StepBatch
from .settings import BuiltinEngineSettings
from .step_time import StepTime
from .timings import TimingsLog
from .wire_engine_side import OutputEncoder, ReceivedRequest, WireDecodeError, decode_message, request_id_of

logger = logging.getLogger("mmserve.builtin_engine")

MM_CACHE_ITEMS = 1024
MAX_MESSAGES_PER_TICK = 1000


class FatalEngineError(RuntimeError):
    """Ends the engine with ENGINE_CORE_DEAD, as an engine-core failure ends a vLLM engine."""


class BuiltinEngine:
    """One engine process's state and loop (single-threaded, zmq.Poller-driven)."""

    def __init__(self, settings: BuiltinEngineSettings) -> None:
        self.settings = settings
        self.model = ModelInfo.load(Path(settings.model_dir))
        self.instance_id = f"mmserve-builtin-{uuid.uuid4().hex[:12]}"
        self.num_gpu_blocks = max(1, settings.max_model_len * min(settings.max_num_seqs, 64) // settings.block_size)
        self.scheduler = Scheduler(
            max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len,
            kv_capacity_tokens=self.num_gpu_blocks * settings.block_size,
        )
        self.step_time = StepTime(settings.step_interval_ms, settings.step_us_per_sequence, settings.step_us_per_prefill_token)
        self.timings = TimingsLog()
        self._ctx = zmq.Context()
        self._inputs: list[zmq.Socket] = []
        self._outputs: list[zmq.Socket] = []
        self._encoder = OutputEncoder()
        self._proof_lines = ProofLines(MM_CACHE_ITEMS)
        self._stop = threading.Event()
        self.steps = 0

    # ------------------------------------------------------------------ control

    def request_shutdown(self) -> None:
        """Finish in-flight requests with ABORT outputs and exit (safe from a signal handler)."""
        self._stop.set()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def run(self) -> int:
        """Handshake, serve until shutdown; returns the process exit code."""
        logger.warning(
            "this is the mmserve BUILT-IN engine: a deterministic text generator, NOT a real model "
            "(vLLM %s wire protocol, max_model_len=%d, max_num_seqs=%d, model dir %s)",
            VLLM_VERSION, self.settings.max_model_len, self.settings.max_num_seqs, self.settings.model_dir,
        )
        try:
            sockets = handshake(self._ctx, self.settings, self._ready_response(), self._stop)
            if sockets is None:
                return 0
            self._inputs, self._outputs = sockets
            self._serve()
            self._shutdown_abort_all()
            return 0
        except Exception:
            logger.exception("fatal error in the built-in engine")
            self._send_dead()
            return 1
        finally:
            self._close()

    def _ready_response(self) -> dict[str, Any]:
        return ready_response(self.settings, self.num_gpu_blocks, self.instance_id)

    # ------------------------------------------------------------------ loop

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in self._inputs:
            poller.register(sock, zmq.POLLIN)
        # The step in progress: its batch was fixed when it began, its tokens leave when it ends.
        batch: StepBatch | None = None
        step_end = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            timeout_ms = max(0.0, (step_end - now) * 1000.0) if batch is not None else 100.0
            try:
                ready = dict(poller.poll(math.ceil(timeout_ms)))
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EINTR:
                    continue
                raise
            for sock in self._inputs:
                if ready.get(sock):
                    self._drain(sock)
            now = time.monotonic()
            if batch is not None and now >= step_end:
                self._finish_step(batch)
                batch = None
            if batch is None and self.has_work:
                batch = self.scheduler.begin_step()
                step_end = now + self.step_time.seconds(batch.sequences, batch.prefill_tokens)

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(MAX_MESSAGES_PER_TICK):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle_message(frames)

    def _handle_message(self, frames: list[bytes]) -> None:
        try:
            rtype, payload = decode_message(frames)
        except WireDecodeError as exc:
            rid = request_id_of(frames[1]) if len(frames) > 1 and frames[0] == RequestType.ADD.value else None
            logger.error("undecodable %s message dropped: %s", "ADD" if rid else "input", exc)
            if rid is not None:
                # We know which request it was: fail it rather than leave the client waiting.
                self._send({0: [EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR)]})
            return
        except Exception:
            logger.exception("undecodable input message dropped")
            return
        try:
            if rtype is RequestType.ADD:
                self._add(payload)
            elif rtype is RequestType.ABORT:
                for rid in payload:
                    self.scheduler.abort(rid)
            elif rtype is RequestType.UTILITY:
                self._utility(*payload)
            else:
                logger.debug("ignoring %s message", rtype.name)
        except FatalEngineError:
            raise
        except Exception:
            logger.exception("error handling a %s message (engine continues)", rtype.name)
            if rtype is RequestType.ADD:
                self.scheduler.abort(payload.request_id)
                self._send({payload.client_index: [
                    EngineCoreOutput(payload.request_id, [], finish_reason=FinishReason.ERROR)
                ]})

    def utilities(self) -> dict[str, Callable[..., Any]]:
        """The EngineCore methods this engine answers as UTILITY calls, by name."""
        return {
            "is_sleeping": lambda: False,
            "has_work": lambda: self.has_work,
            "get_supported_tasks": lambda: ["generate"],
            "reset_prefix_cache": lambda *a, **k: True,
            "reset_mm_cache": lambda: self._proof_lines.clear(),
            "reset_encoder_cache": lambda: None,
            "get_request_timings": self.get_request_timings,
        }

    def _utility(self, client_index: int, call_id: int, method: str, args: list[Any]) -> None:
        handler = self.utilities().get(method)
        if handler is None:
            out = UtilityOutput(call_id, failure_message=f"Call to {method} method failed: "
                                f"'BuiltinEngine' object has no attribute '{method}'")
        else:
            try:
                out = UtilityOutput(call_id, result=[None, handler(*args)])
            except FatalEngineError:
                raise
            except Exception as exc:
                out = UtilityOutput(call_id, failure_message=f"Call to {method} method failed: {exc}")
        self._send_outputs(client_index, EngineCoreOutputs(utility_output=out, timestamp=time.monotonic()))

    def get_request_timings(self, request_ids: list[str] | None = None, clear: bool = False) -> list[dict[str, Any]]:
        return self.timings.query(request_ids, clear)

    # ------------------------------------------------------------------ requests

    def _add(self, req: ReceivedRequest) -> None:
        rid = req.request_id
        if rid in self.scheduler:
            logger.error("duplicate request id %r ignored", rid)
            return
        self.timings.start(rid, req.arrival_time, time.time())

        def fail(reason: str, **extra: Any) -> None:
            logger.error("request %s rejected: %s", rid, reason)
            self._send({req.client_index: [EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, **extra)]})

        if req.sampling is None:
            return fail("pooling requests are not supported by the built-in engine")
        prompt = req.prompt_token_ids
        if not prompt:
            return fail("empty prompt")
        max_model_len = self.settings.max_model_len
        if len(prompt) >= max_model_len:
            return fail(f"prompt of {len(prompt)} tokens does not fit max_model_len {max_model_len}")

        try:
            lines, missing = self._proof_lines.for_request(self.model, prompt, req.mm_features)
        except MultimodalError as exc:
            return fail(f"inconsistent multimodal input: {exc}")
        if missing:
            return fail(f"multimodal items not cached: {missing}", mm_cache_miss_hashes=missing)
        self.scheduler.add(new_generation(self.model, self.settings, req, lines))

    def _finish_step(self, batch: StepBatch) -> None:
        outbox = self.scheduler.finish_step(batch)
        self.steps += 1
        self._send(outbox.by_client, with_stats=True)

    # ------------------------------------------------------------------ sending

    def _send(self, by_client: dict[int, list[EngineCoreOutput]], with_stats: bool = False) -> None:
        stats = self.scheduler.stats() if with_stats else None
        now = time.time()
        for outputs in by_client.values():
            for output in outputs:
                self.timings.record(output.request_id, now, len(output.new_token_ids))
        for client_index, outputs in by_client.items():
            self._send_outputs(
                client_index,
                EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic()),
            )

    def _send_outputs(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        outputs.engine_index = self.settings.dp_rank
        if not 0 <= client_index < len(self._outputs):
            logger.error("no output socket for client index %d; output dropped", client_index)
            return
        self._outputs[client_index].send(self._encoder.encode(outputs))

    def _shutdown_abort_all(self) -> None:
        outbox = self.scheduler.abort_all()
        if outbox.by_client:
            n = sum(len(v) for v in outbox.by_client.values())
            logger.info("shutting down: aborting %d in-flight request(s)", n)
            self._send(outbox.by_client, with_stats=True)
        else:
            logger.info("shutting down")

    def _send_dead(self) -> None:
        for sock in self._outputs:
            try:
                sock.send(ENGINE_CORE_DEAD)
            except Exception:  # pragma: no cover - best effort on the way out
                logger.exception("could not send ENGINE_CORE_DEAD")

    def _close(self) -> None:
        for sock in [*self._inputs, *self._outputs]:
            sock.close()  # linger lets queued outputs (ABORTs, ENGINE_CORE_DEAD) leave
        self._inputs, self._outputs = [], []
        self._ctx.term()
