"""What travels over the preprocessing link: engine clients' jobs to a preprocessor replica's inbox, and its answers, the pixels named in the store.

A job is one small message (`PreprocessJob`, its images' URLs or data URIs inside); its answer is one
message too, a msgpack header whose large arrays are not in it: the replica writes them once into the
pixel store (Ray's object store: `deployments/pixel_store.py`) and the answer names them there
(`JobAnswer.pixels`). The engine client maps them in place, tells the replica it has
(`ReleasePixels`: the replica then lets them go, and the memory stays only as long as the engine
client's own mapping, until the engine's socket has sent it), and hands that memory to the engine's
socket uncopied. Arrays below `STORE_MIN_BYTES`, which every socket copies anyway, travel inside the
header. Every message is numbered on its link (`sockets.LinkMessage`), which is how a lost one is found.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
import numpy as np

from ..multimodal.types import ImageBatchRequest, ProcessedImages
from .refusals import Refusal
from .sockets import LinkMessage

# Arrays this large or larger go through the pixel store; smaller ones inside the answer (the engine's
# socket copies anything smaller than this, as pyzmq does: `mmserve/engine/transport.py`).
STORE_MIN_BYTES = 64 * 1024


class PixelStore(Protocol):
    """Where a preprocessor replica writes a request's large arrays for the engine client that asked
    (Ray's object store in a deployment: `deployments/pixel_store.py`)."""

    def put(self, arrays: list[np.ndarray]) -> tuple[bytes, Any]:
        """Write `arrays` once: their name for the reader, and the writer's hold on them (they stay
        while it is kept)."""
        ...

    async def get(self, name: bytes) -> list[np.ndarray]:
        """The arrays named `name`, mapped where they lie (read-only); raises `LinkLost` (freed, or
        their writer died)."""
        ...


class PreprocessorHello(msgspec.Struct, frozen=True):
    """A replica's answer to an engine client attaching (`PreprocessorDeployment.subscribe`)."""

    # The replica's inbox, where jobs go.
    inbox: str
    # Its unique id in Serve (empty outside a replica).
    replica: str


class PreprocessJob(LinkMessage, frozen=True, tag="job"):
    """One request's images to process; answered to the inbox at `reply_to` under `job`."""

    reply_to: str
    job: int
    request: ImageBatchRequest


class CancelJobs(LinkMessage, frozen=True, tag="cancel"):
    """The sender at `reply_to` no longer wants these jobs' answers (its requests were aborted, or
    lost): the replica stops them, and lets their pixels go if it answered already."""

    reply_to: str
    jobs: list[int]


class ReleasePixels(LinkMessage, frozen=True, tag="release"):
    """The sender at `reply_to` has mapped these jobs' pixels (or will never read them): the replica
    lets them go."""

    reply_to: str
    jobs: list[int]


class Probe(LinkMessage, frozen=True, tag="probe"):
    """The sender at `reply_to` waits for answers and has heard nothing for a while: the replica
    answers with a numbered `JobAnswer` of job 0 (`sockets.LINK_PROBE_S`)."""

    reply_to: str


# What an engine client sends a preprocessor replica's inbox.
PreprocessorMessage = PreprocessJob | CancelJobs | ReleasePixels | Probe


class JobAnswer(LinkMessage, frozen=True, omit_defaults=True):
    """An answer from the replica whose inbox is `sender`: the images or the refusal of `job`, or
    (job 0) the answer to a probe, or news that messages from this engine client were lost (`lost`:
    the replica dropped every job of its then, and their pixels). Each array of `images` is encoded as
    `[dtype, shape, data]`, `data` being its bytes (a small array) or its index in the arrays the store
    holds under `pixels` (as vLLM's own wire encodes arrays, with frames: `mmserve/wire/codec.py`)."""

    sender: str
    job: int
    images: ProcessedImages | None = None
    refused: Refusal | None = None
    # The name of the answer's large arrays in the pixel store (None: it has none).
    pixels: bytes | None = None
    lost: bool = False

    @property
    def answer(self) -> ProcessedImages | Refusal:
        if self.images is not None:
            return self.images
        if self.refused is not None:
            return self.refused
        raise AnswerError(f"the answer to job {self.job} holds neither images nor a refusal")


class AnswerHead(LinkMessage, frozen=True):
    """What the engine client reads of an answer before its pixels."""

    sender: str
    job: int
    pixels: bytes | None = None
    lost: bool = False


class AnswerError(ValueError):
    """An answer that makes no answer (a peer of another version, or a bug)."""


_encoder = msgspec.msgpack.Encoder()
_message_decoder: msgspec.msgpack.Decoder[PreprocessorMessage] = msgspec.msgpack.Decoder(PreprocessorMessage)  # type: ignore[arg-type]
_head_decoder = msgspec.msgpack.Decoder(AnswerHead)

encode = _encoder.encode


def decode_message(data: bytes) -> PreprocessorMessage:
    return _message_decoder.decode(data)


def answer_of(
    sender: str, job: int, answer: ProcessedImages | Refusal, put: Callable[[list[np.ndarray]], tuple[bytes, Any]]
) -> tuple[JobAnswer, Any]:
    """The answer's message, and the hold on its pixels in the store (None: it put none there). The
    large arrays are written there with one `put`."""
    stored: list[np.ndarray] = []

    def array_ref(value: Any) -> Any:
        if not isinstance(value, np.ndarray):
            raise TypeError(f"cannot encode {type(value).__name__}")
        array = np.ascontiguousarray(value)
        if array.nbytes < STORE_MIN_BYTES:
            return [array.dtype.str, list(array.shape), array.tobytes()]
        stored.append(array)
        return [array.dtype.str, list(array.shape), len(stored) - 1]

    if isinstance(answer, Refusal):
        return JobAnswer(sender=sender, job=job, refused=answer), None
    images = msgspec.msgpack.Encoder(enc_hook=array_ref).encode(answer)
    name, hold = put(stored) if stored else (None, None)
    # The images are encoded once, before the put that names their arrays; the message around them after.
    return JobAnswer(sender=sender, job=job, images=msgspec.Raw(images), pixels=name), hold  # type: ignore[arg-type]


def decode_head(data: bytes) -> AnswerHead:
    try:
        return _head_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise AnswerError(str(exc)) from None


def decode_answer(data: bytes, stored: Sequence[np.ndarray] = ()) -> JobAnswer:
    """The answer of `data`, its large arrays taken from `stored` (what the store holds under its
    `pixels`, uncopied); the small ones read-only copies out of `data`."""

    def array_of(kind: type, value: Any) -> Any:
        if kind is not np.ndarray:
            raise TypeError(f"cannot decode {kind}")
        dtype, shape, data = value
        if isinstance(data, int):
            if not 0 <= data < len(stored):
                raise ValueError(f"an array reference {data} names none of {len(stored)} stored arrays")
            array = stored[data]
            if array.dtype != np.dtype(dtype) or list(array.shape) != list(shape):
                raise ValueError(f"stored array {data} is {array.dtype}{list(array.shape)}, not {dtype}{shape}")
            return array
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)

    try:
        return msgspec.msgpack.Decoder(JobAnswer, dec_hook=array_of).decode(data)
    except msgspec.DecodeError as exc:  # (a `ValidationError` too: a dtype or shape its data cannot hold)
        raise AnswerError(str(exc)) from None
