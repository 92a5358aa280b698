"""mmserve's built-in engine: a deterministic stand-in for `vllm serve --headless`.

It is NOT a model. It plays a vLLM 0.32 EngineCore on the same ZMQ wire so that the gateway
runs end to end on a laptop without a GPU or vLLM:

- handshake: DEALER (identity = DP rank, 2 bytes LE) → the front-end's handshake ROUTER:
  HELLO, init map, then a DEALER to the input address and a PUSH to the output address, the
  ready response on the input socket, READY on the handshake socket.
- ADD queues a request, ABORT drops requests silently (vLLM sends nothing for client aborts),
  UTILITY answers `is_sleeping`, `has_work`, `get_supported_tasks`, ... .
- every `step_interval_ms` while there is work, every running request gets one token; all of
  a step's tokens travel in one `EngineCoreOutputs` with scheduler stats.
- per request it records wall times (`time.time()`) for benchmarks: the ADD's `arrival_time`
  (stamped by the front-end), when the ADD was decoded here, and when each output frame was
  sent; the `get_request_timings` utility returns them (a ring buffer of the last
  `TIMINGS_MAX_REQUESTS` requests, the first `TIMINGS_MAX_FRAMES` frames of each).

Token rule (deterministic): a PRNG keyed by the prompt token ids and multimodal identifiers
(plus the seed when one is given; greedy requests ignore it; sampled requests without a seed
use a random key) draws readable words, mostly from a fixed word list and partly from the
prompt's own words, and the words are tokenized with the model directory's tokenizer. For each
multimodal item the answer starts with a proof line computed from what arrived, e.g.
`[image 1: grid 1x16x20, 320 patches uint8, sha256 3fa4c0ffee123456]`. The same PRNG picks a
natural length of 8–40 tokens after the proof lines; then the request's EOS
(`_eos_token_id`) is emitted. Stop rules follow vLLM 0.32's `check_stop`: EOS → STOP,
a `stop_token_ids` member → STOP with stop_reason, then max_tokens / max_model_len → LENGTH;
stop tokens are masked while fewer than `min_tokens` tokens were produced.
"""

from __future__ import annotations

import array
import collections
import hashlib
import json
import logging
import math
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq

from ..wire.engine_core import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    RequestType,
    SchedulerStats,
    UtilityOutput,
)
from ..wire.handshake import HandshakeInit, engine_identity
from .wire_engine_side import (
    OutputEncoder,
    ReceivedFeature,
    ReceivedRequest,
    ReceivedTensor,
    WireDecodeError,
    decode_message,
    request_id_of,
)

logger = logging.getLogger("mmserve.builtin_engine")

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "model"
VLLM_VERSION = "0.32.0"
HANDSHAKE_TIMEOUT_S = 300.0  # vLLM's HANDSHAKE_TIMEOUT_MINS = 5
MM_CACHE_ITEMS = 1024
MAX_MESSAGES_PER_TICK = 1000
# Request timings for benchmarks: bounded (≤ 10k × 512 × 2 doubles ≈ 80 MB in the worst case,
# a few MB for ordinary requests).
TIMINGS_MAX_REQUESTS = 10_000
TIMINGS_MAX_FRAMES = 512


@dataclass(frozen=True)
class BuiltinEngineConfig:
    handshake_address: str
    model_dir: Path = DEFAULT_MODEL_DIR
    max_model_len: int = 4096
    max_num_seqs: int = 256
    step_interval_ms: float = 2.0
    dp_rank: int = 0
    block_size: int = 16
    min_answer_tokens: int = 8
    max_answer_tokens: int = 40


# ----------------------------------------------------------------------------- the "model"

_WORDS = (
    "the a quiet bright small river mountain lantern garden window morning evening signal engine "
    "token answer question picture image color light shadow stone paper cloud ocean forest road "
    "city bridge tower market letter number pattern circle square line corner edge surface "
    "detail shows holds carries follows reaches turns waits sees finds keeps brings makes "
    "slowly clearly softly nearly always often again together beyond under above between "
    "red blue green golden silver gray warm cold calm steady simple gentle careful curious "
    "is are was were has have with from into over near and but so because while then"
).split()

_SKIP_PROMPT_WORDS = frozenset(
    "system user assistant you are helpful the and for with this that what which who how "
    "please describe image picture vision".split()
)


@dataclass(frozen=True)
class ModelInfo:
    tokenizer: Any | None  # tokenizers.Tokenizer
    image_token_id: int
    video_token_id: int
    merge_size: int
    vocab_size: int
    special_ids: frozenset[int]

    @classmethod
    def load(cls, model_dir: Path) -> ModelInfo:
        config: dict[str, Any] = {}
        config_path = model_dir / "config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        else:
            logger.warning("no config.json in %s: using Qwen2-VL default token ids", model_dir)
        vision = config.get("vision_config") or {}
        tokenizer = None
        special: set[int] = set()
        tok_path = model_dir / "tokenizer.json"
        if tok_path.is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(tok_path))
            special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
        else:
            logger.warning("no tokenizer.json in %s: answering with token ids only", model_dir)
        return cls(
            tokenizer=tokenizer,
            image_token_id=int(config.get("image_token_id", 151655)),
            video_token_id=int(config.get("video_token_id", 151656)),
            merge_size=int(vision.get("spatial_merge_size", 2)),
            vocab_size=int(config.get("vocab_size", 1000)),
            special_ids=frozenset(special),
        )

    def encode(self, text: str) -> list[int]:
        assert self.tokenizer is not None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt_words(self, prompt: list[int]) -> list[str]:
        """Distinct words of the prompt's text (last ones first), to echo in answers."""
        if self.tokenizer is None:
            return []
        ids = [t for t in prompt[-512:] if t not in self.special_ids and 0 <= t < self.vocab_size]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        seen: dict[str, None] = {}
        for word in reversed(re.findall(r"[A-Za-z]{3,}", text)):
            w = word.lower()
            if w not in _SKIP_PROMPT_WORDS:
                seen.setdefault(w, None)
            if len(seen) >= 12:
                break
        return list(seen)


def _answer_stream(model: ModelInfo, rng: random.Random, prefix: str, prompt_words: list[str]) -> Iterator[int]:
    """Ordinary (non-special) token ids, forever: the proof lines, then sentences."""
    if model.tokenizer is None:
        limit = min(model.vocab_size, min(model.special_ids, default=model.vocab_size)) or 1000
        while True:
            yield rng.randrange(limit)
    if prefix:
        yield from model.encode(prefix)
    first = True
    while True:
        n = rng.randint(5, 11)
        words = [
            rng.choice(prompt_words) if prompt_words and rng.random() < 0.25 else rng.choice(_WORDS)
            for _ in range(n)
        ]
        sentence = " ".join(words).capitalize() + rng.choice("...!?")[0]
        yield from model.encode(sentence if first else " " + sentence)
        first = False


# ----------------------------------------------------------------------------- multimodal checks


class MultimodalError(ValueError):
    pass


class FatalEngineError(RuntimeError):
    """Ends the engine (ENGINE_CORE_DEAD); raised on purpose only by the test hook."""


# Set to 1 to enable the `mmserve_test_fatal` utility (tests of ENGINE_CORE_DEAD handling).
TEST_HOOKS_ENV = "MMSERVE_BUILTIN_ENGINE_TEST_HOOKS"


def _flat_tensor(value: Any, key: str) -> ReceivedTensor:
    if not isinstance(value, ReceivedTensor):
        raise MultimodalError(f"{key}: expected one tensor, got {type(value).__name__}")
    return value


def _describe_feature(model: ModelInfo, feature: ReceivedFeature, index: int) -> str:
    """The proof line of one multimodal item; raises MultimodalError if it is inconsistent."""
    assert feature.data is not None
    data = {k: v.data for k, v in feature.data.items()}
    modality = feature.modality
    pixel_key, grid_key = {
        "image": ("pixel_values", "image_grid_thw"),
        "video": ("pixel_values_videos", "video_grid_thw"),
    }.get(modality, (None, None))
    embed_count = feature.length
    if feature.is_embed is not None:
        embed_count = sum(1 for b in feature.is_embed.data if b)
    if pixel_key in data and grid_key in data:
        pixels = _flat_tensor(data[pixel_key], pixel_key)
        grid = _flat_tensor(data[grid_key], grid_key)
        thw = grid.as_ints()
        if len(thw) != 3 or any(v <= 0 for v in thw):
            raise MultimodalError(f"{grid_key} must hold 3 positive ints, got {thw}")
        t, h, w = thw
        patches = pixels.shape[0] if pixels.shape else 0
        if patches != t * h * w:
            raise MultimodalError(f"{pixel_key} has {patches} patches, grid {t}x{h}x{w} needs {t * h * w}")
        tokens = t * h * w // (model.merge_size**2)
        if tokens != embed_count:
            raise MultimodalError(
                f"grid {t}x{h}x{w} makes {tokens} placeholder tokens, mm_position says {embed_count}"
            )
        digest = hashlib.sha256(pixels.data).hexdigest()[:16]
        return f"[{modality} {index}: grid {t}x{h}x{w}, {patches} patches {pixels.dtype}, sha256 {digest}]"
    # Any other item: list its tensors and hash them in key order.
    sha = hashlib.sha256()
    parts = []
    for key in sorted(data):
        value = data[key]
        if isinstance(value, ReceivedTensor):
            sha.update(value.data)
            parts.append(f"{key} {value.dtype}{list(value.shape)}")
        else:
            parts.append(f"{key} {type(value).__name__}")
    return f"[{modality} {index}: {', '.join(parts) or 'no data'}, sha256 {sha.hexdigest()[:16]}]"


def _check_positions(model: ModelInfo, prompt: list[int], feature: ReceivedFeature) -> None:
    off, length = feature.offset, feature.length
    if off < 0 or length <= 0 or off + length > len(prompt):
        raise MultimodalError(
            f"{feature.modality} placeholder [{off}, {off + length}) outside the prompt of {len(prompt)} tokens"
        )
    pad = {"image": model.image_token_id, "video": model.video_token_id}.get(feature.modality)
    if pad is None:
        return
    mask = None
    if feature.is_embed is not None:
        if feature.is_embed.shape != (length,):
            raise MultimodalError(f"is_embed shape {feature.is_embed.shape} != ({length},)")
        mask = feature.is_embed.data
    for i in range(length):
        if (mask is None or mask[i]) and prompt[off + i] != pad:
            raise MultimodalError(
                f"prompt token {off + i} is {prompt[off + i]}, expected the {feature.modality} token {pad}"
            )


# ----------------------------------------------------------------------------- requests


@dataclass(eq=False)
class _Request:
    request_id: str
    client_index: int
    prompt_len: int
    max_tokens: int
    min_tokens: int
    eos: int | None
    stop_ids: frozenset[int]
    all_stop_ids: frozenset[int]
    natural_len: int
    stream: Iterator[int]
    num_output: int = 0

    def next_token(self) -> int:
        n = self.num_output
        if self.eos is not None and n >= max(self.natural_len, self.min_tokens):
            return self.eos
        tok = next(self.stream)
        while n < self.min_tokens and tok in self.all_stop_ids:
            tok = next(self.stream)
        return tok


@dataclass
class _Outbox:
    """Outputs of one step (or one event), grouped by client index."""

    by_client: dict[int, list[EngineCoreOutput]] = field(default_factory=dict)

    def add(self, client_index: int, output: EngineCoreOutput) -> None:
        self.by_client.setdefault(client_index, []).append(output)


class _RequestTimings:
    """Wall times (`time.time()`) of one request, for `get_request_timings`."""

    __slots__ = ("request_id", "arrival_time", "received", "sent", "num_tokens")

    def __init__(self, request_id: str, arrival_time: float, received: float) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time  # stamped by the front-end (EngineCoreRequest.arrival_time)
        self.received = received  # the ADD decoded by this engine
        self.sent = array.array("d")  # each output frame of this request, just before its send
        self.num_tokens = array.array("i")  # new tokens in that frame

    def record(self, when: float, num_tokens: int) -> None:
        if len(self.sent) < TIMINGS_MAX_FRAMES:
            self.sent.append(when)
            self.num_tokens.append(num_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "arrival_time": self.arrival_time,
            "received": self.received,
            "sent": self.sent.tolist(),
            "num_tokens": self.num_tokens.tolist(),
        }


# ----------------------------------------------------------------------------- the engine


class BuiltinEngine:
    """One engine process's state and loop (single-threaded, zmq.Poller-driven)."""

    def __init__(self, config: BuiltinEngineConfig) -> None:
        self.config = config
        self.model = ModelInfo.load(Path(config.model_dir))
        self.instance_id = f"mmserve-builtin-{uuid.uuid4().hex[:12]}"
        self.num_gpu_blocks = max(1, config.max_model_len * min(config.max_num_seqs, 64) // config.block_size)
        self._ctx = zmq.Context()
        self._inputs: list[zmq.Socket] = []
        self._outputs: list[zmq.Socket] = []
        self._encoder = OutputEncoder()
        self._waiting: collections.OrderedDict[str, _Request] = collections.OrderedDict()
        self._running: dict[str, _Request] = {}
        self._mm_cache: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._stop = threading.Event()
        self.steps = 0
        # Insertion-ordered; the oldest entries are dropped beyond TIMINGS_MAX_REQUESTS.
        self._timings: collections.OrderedDict[str, _RequestTimings] = collections.OrderedDict()

    # ------------------------------------------------------------------ control

    def request_shutdown(self) -> None:
        """Finish in-flight requests with ABORT outputs and exit (safe from a signal handler)."""
        self._stop.set()

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def run(self) -> int:
        """Handshake, serve until shutdown; returns the process exit code."""
        logger.warning(
            "this is the mmserve BUILT-IN engine: a deterministic text generator, NOT a real model "
            "(vLLM %s wire protocol, max_model_len=%d, max_num_seqs=%d, model dir %s)",
            VLLM_VERSION, self.config.max_model_len, self.config.max_num_seqs, self.config.model_dir,
        )
        try:
            if not self._handshake():
                return 0
            self._serve()
            self._shutdown_abort_all()
            return 0
        except Exception:
            logger.exception("fatal error in the built-in engine")
            self._send_dead()
            return 1
        finally:
            self._close()

    # ------------------------------------------------------------------ handshake

    def _sock(self, kind: int, address: str, identity: bytes | None = None, linger_ms: int = 4000) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(address)
        return sock

    def _handshake(self) -> bool:
        identity = engine_identity(self.config.dp_rank)
        hs = self._sock(zmq.DEALER, self.config.handshake_address, identity, linger_ms=5000)
        try:
            hs.send(msgspec.msgpack.encode({"status": "HELLO", "local": False, "headless": True}))
            logger.info("said HELLO to %s; waiting for the front-end", self.config.handshake_address)
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
            while not hs.poll(100):
                if self._stop.is_set():
                    logger.info("shutdown requested before the handshake completed")
                    return False
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Did not receive response from front-end process within {HANDSHAKE_TIMEOUT_S / 60:.0f} minutes"
                    )
            init = msgspec.msgpack.decode(hs.recv(), type=HandshakeInit)
            addresses = init.addresses
            if not addresses.inputs or not addresses.outputs:
                raise RuntimeError(f"handshake init without input/output addresses: {addresses}")
            self._inputs = [self._sock(zmq.DEALER, a, identity) for a in addresses.inputs]
            self._outputs = [self._sock(zmq.PUSH, a) for a in addresses.outputs]
            ready = self._encoder.encode_map(self._ready_response())
            for sock in self._inputs:
                # Teaches the front-end ROUTER our identity.
                sock.send(ready)
            hs.send(msgspec.msgpack.encode({"status": "READY", "local": False, "headless": True}))
            logger.info("READY: inputs=%s outputs=%s", addresses.inputs, addresses.outputs)
            return True
        finally:
            hs.close()

    def _ready_response(self) -> dict[str, Any]:
        c = self.config
        kv_tokens = self.num_gpu_blocks * c.block_size
        return {
            "max_model_len": c.max_model_len,
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_size": c.block_size,
            "dp_stats_address": None,
            "dtype": "bfloat16",
            "vllm_version": VLLM_VERSION,
            "world_size": 1,
            "data_parallel_size": 1,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "decode_context_parallel_size": 1,
            "data_parallel_rank": c.dp_rank,
            "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": max(c.max_model_len, 8192),
            "instance_id": self.instance_id,
            "supports_lora": False,
            "max_loras": 0,
            "mamba_block_size": None,
            "kv_cache_size_tokens": kv_tokens,
            "kv_cache_max_concurrency": kv_tokens / c.max_model_len,
            "kv_events_config": None,
            "weight_transfer_backend": None,
            "enable_sleep_mode": False,
        }

    # ------------------------------------------------------------------ loop

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in self._inputs:
            poller.register(sock, zmq.POLLIN)
        interval = self.config.step_interval_ms / 1000.0
        next_step = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if self.has_work:
                timeout_ms = max(0.0, (next_step - now) * 1000.0)
            else:
                timeout_ms = 100.0
            try:
                ready = dict(poller.poll(math.ceil(timeout_ms)))
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EINTR:
                    continue
                raise
            had_work = self.has_work
            for sock in self._inputs:
                if ready.get(sock):
                    self._drain(sock)
            now = time.monotonic()
            if not had_work and self.has_work:
                next_step = now  # new work after idling: step at once
            if self.has_work and now >= next_step:
                self._step()
                next_step = max(next_step + interval, now)

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
                    self._waiting.pop(rid, None)
                    self._running.pop(rid, None)
            elif rtype is RequestType.UTILITY:
                self._utility(*payload)
            else:
                logger.debug("ignoring %s message", rtype.name)
        except FatalEngineError:
            raise
        except Exception:
            logger.exception("error handling a %s message (engine continues)", rtype.name)
            if rtype is RequestType.ADD:
                self._running.pop(payload.request_id, None)
                self._waiting.pop(payload.request_id, None)
                self._send({payload.client_index: [
                    EngineCoreOutput(payload.request_id, [], finish_reason=FinishReason.ERROR)
                ]})

    def _utility(self, client_index: int, call_id: int, method: str, args: list[Any]) -> None:
        handlers = {
            "is_sleeping": lambda: False,
            "has_work": lambda: self.has_work,
            "get_supported_tasks": lambda: ["generate"],
            "reset_prefix_cache": lambda *a, **k: True,
            "reset_mm_cache": lambda: self._mm_cache.clear(),
            "reset_encoder_cache": lambda: None,
            "get_request_timings": self.get_request_timings,
        }
        if os.environ.get(TEST_HOOKS_ENV) == "1" and method == "mmserve_test_fatal":
            raise FatalEngineError("fatal error requested by the mmserve_test_fatal utility")
        handler = handlers.get(method)
        if handler is None:
            out = UtilityOutput(call_id, failure_message=f"Call to {method} method failed: "
                                f"'BuiltinEngine' object has no attribute '{method}'")
        else:
            try:
                out = UtilityOutput(call_id, result=[None, handler(*args)])
            except Exception as exc:
                out = UtilityOutput(call_id, failure_message=f"Call to {method} method failed: {exc}")
        self._send_outputs(client_index, EngineCoreOutputs(utility_output=out, timestamp=time.monotonic()))

    # ------------------------------------------------------------------ requests

    def get_request_timings(self, request_ids: list[str] | None = None, clear: bool = False) -> list[dict[str, Any]]:
        """Timings of the recorded requests (oldest first), or of `request_ids` only.

        Each: request_id, arrival_time (front-end's stamp), received (ADD decoded here), sent
        (wall time of each output frame, just before its send) and num_tokens (per frame).
        `clear` forgets everything recorded so far.
        """
        if request_ids is None:
            result = [t.as_dict() for t in self._timings.values()]
        else:
            result = [self._timings[r].as_dict() for r in request_ids if r in self._timings]
        if clear:
            self._timings.clear()
        return result

    def _add(self, req: ReceivedRequest) -> None:
        rid = req.request_id
        if rid in self._running or rid in self._waiting:
            logger.error("duplicate request id %r ignored", rid)
            return
        self._timings.pop(rid, None)
        self._timings[rid] = _RequestTimings(rid, req.arrival_time, time.time())
        while len(self._timings) > TIMINGS_MAX_REQUESTS:
            self._timings.popitem(last=False)

        def fail(reason: str, **extra: Any) -> None:
            logger.error("request %s rejected: %s", rid, reason)
            self._send({req.client_index: [EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, **extra)]})

        s = req.sampling
        if s is None:
            return fail("pooling requests are not supported by the built-in engine")
        prompt = req.prompt_token_ids
        if not prompt:
            return fail("empty prompt")
        max_model_len = self.config.max_model_len
        if len(prompt) >= max_model_len:
            return fail(f"prompt of {len(prompt)} tokens does not fit max_model_len {max_model_len}")

        lines = []
        missing: list[str] = []
        counts: dict[str, int] = {}
        for feature in req.mm_features:
            counts[feature.modality] = index = counts.get(feature.modality, 0) + 1
            cache_key = feature.mm_hash or feature.identifier
            try:
                _check_positions(self.model, prompt, feature)
                if feature.data is None:
                    line = self._mm_cache.get(cache_key)
                    if line is None:
                        missing.append(cache_key)
                        continue
                    self._mm_cache.move_to_end(cache_key)
                    line = re.sub(r"^\[\S+ \d+:", f"[{feature.modality} {index}:", line)
                else:
                    line = _describe_feature(self.model, feature, index)
                    self._mm_cache[cache_key] = line
                    if len(self._mm_cache) > MM_CACHE_ITEMS:
                        self._mm_cache.popitem(last=False)
            except MultimodalError as exc:
                return fail(f"inconsistent multimodal input: {exc}")
            lines.append(line)
        if missing:
            return fail(f"multimodal items not cached: {missing}", mm_cache_miss_hashes=missing)

        # The PRNG key: prompt + items; the seed only matters for sampled requests.
        if s.temperature > 0 and s.seed is None:
            key = os.urandom(16)
        else:
            h = hashlib.sha256()
            h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in prompt))
            for feature in req.mm_features:
                h.update(feature.identifier.encode() + b"\0")
            if s.temperature > 0:
                h.update(f"seed={s.seed}".encode())
            key = h.digest()
        rng = random.Random(key)
        prefix = "".join(line + "\n" for line in lines)
        stream = _answer_stream(self.model, rng, prefix, self.model.prompt_words(prompt))
        prefix_tokens = len(self.model.encode(prefix)) if prefix and self.model.tokenizer is not None else 0
        natural = prefix_tokens + rng.randint(self.config.min_answer_tokens, self.config.max_answer_tokens)
        room = max_model_len - len(prompt)
        max_tokens = room if s.max_tokens is None else max(1, s.max_tokens)
        eos = None if s.ignore_eos else s.eos_token_id
        self._waiting[rid] = _Request(
            request_id=rid,
            client_index=req.client_index,
            prompt_len=len(prompt),
            max_tokens=max_tokens,
            min_tokens=max(0, s.min_tokens),
            eos=eos,
            stop_ids=frozenset(s.stop_token_ids),
            all_stop_ids=frozenset(s.all_stop_token_ids),
            natural_len=natural,
            stream=stream,
        )

    def _step(self) -> None:
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            rid, req = self._waiting.popitem(last=False)
            self._running[rid] = req
        outbox = _Outbox()
        finished: list[str] = []
        max_model_len = self.config.max_model_len
        for rid, req in self._running.items():
            tok = req.next_token()
            req.num_output += 1
            finish: FinishReason | None = None
            stop_reason: int | None = None
            if req.eos is not None and tok == req.eos:
                finish = FinishReason.STOP
            elif tok in req.stop_ids:
                finish, stop_reason = FinishReason.STOP, tok
            elif req.prompt_len + req.num_output >= max_model_len or req.num_output >= req.max_tokens:
                finish = FinishReason.LENGTH
            outbox.add(req.client_index, EngineCoreOutput(rid, [tok], finish_reason=finish, stop_reason=stop_reason))
            if finish is not None:
                finished.append(rid)
        for rid in finished:
            del self._running[rid]
        self.steps += 1
        self._send(outbox.by_client, with_stats=True)

    def _stats(self) -> SchedulerStats:
        capacity = self.num_gpu_blocks * self.config.block_size
        used = sum(r.prompt_len + r.num_output for r in self._running.values())
        return SchedulerStats(
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting),
            kv_cache_usage=min(1.0, used / capacity),
        )

    # ------------------------------------------------------------------ sending

    def _send(self, by_client: dict[int, list[EngineCoreOutput]], with_stats: bool = False) -> None:
        stats = self._stats() if with_stats else None
        now = time.time()
        timings = self._timings
        for outputs in by_client.values():
            for output in outputs:
                if (t := timings.get(output.request_id)) is not None:
                    t.record(now, len(output.new_token_ids))
        for client_index, outputs in by_client.items():
            self._send_outputs(
                client_index,
                EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic()),
            )

    def _send_outputs(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        outputs.engine_index = self.config.dp_rank
        if not 0 <= client_index < len(self._outputs):
            logger.error("no output socket for client index %d; output dropped", client_index)
            return
        self._outputs[client_index].send(self._encoder.encode(outputs))

    def _shutdown_abort_all(self) -> None:
        outbox = _Outbox()
        for req in [*self._running.values(), *self._waiting.values()]:
            outbox.add(req.client_index, EngineCoreOutput(req.request_id, [], finish_reason=FinishReason.ABORT))
        self._running.clear()
        self._waiting.clear()
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
