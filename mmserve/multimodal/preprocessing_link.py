"""What travels over the preprocessing link: engine clients' jobs to a preprocessor replica's inbox, and its answers, pixels as frames of their own.

A Serve call to the preprocessor costs both sides ≈14 ms of Ray's and Serve's CPU per image request
(its routing, the replica's two event loops, the result's object-store write and read:
`bench/RESULTS.md`, "by thread"), about what vLLM's whole API server spends on it. Over ZMQ the job
is one small message (`PreprocessJob`, its images' URLs or data URIs inside) and the answer one
multipart message: a msgpack header, then each array's memory as a frame of its own, sent from the
preprocessor's array and received as a ZMQ frame that the engine client's array is a view of, so
the pixels are copied only by the sockets themselves.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import zmq

from .types import ImageBatchRequest, ImagesRefused, ProcessedImages


class PreprocessorHello(msgspec.Struct, frozen=True):
    """A replica's answer to an engine client attaching (`PreprocessorDeployment.subscribe`)."""

    # The replica's inbox, where jobs go.
    inbox: str
    # Its unique id in Serve (empty outside a replica).
    replica: str


class PreprocessJob(msgspec.Struct, frozen=True, tag="job"):
    """One request's images to process; answered to the inbox at `reply_to` under `job`."""

    reply_to: str
    job: int
    request: ImageBatchRequest


class CancelJobs(msgspec.Struct, frozen=True, tag="cancel"):
    """The sender at `reply_to` no longer wants these jobs' answers (its requests were aborted)."""

    reply_to: str
    jobs: list[int]


class AskHeldJobs(msgspec.Struct, frozen=True, tag="held?"):
    """Which of these jobs from the sender at `reply_to` does the replica still hold (working on them,
    or delivering their answers)? Asked of jobs long unanswered: one whose message or answer was lost
    on a broken connection is held nowhere, and would otherwise be waited for forever. Answered with
    `JobAnswer.not_held`, behind every answer sent before (one connection keeps its order)."""

    reply_to: str
    jobs: list[int]


# What an engine client sends a preprocessor replica's inbox.
PreprocessorMessage = PreprocessJob | CancelJobs | AskHeldJobs


class JobAnswer(msgspec.Struct, frozen=True):
    """The header frame of an answer: the images or the refusal; each array of `images` is encoded
    as `[frame, dtype, shape]`, its memory being frame `frame` of the message (the header is 0)."""

    job: int
    images: ProcessedImages | None = None
    refused: ImagesRefused | None = None
    # Set instead (job 0): the answer to `AskHeldJobs`, the jobs asked about that the replica does not hold.
    not_held: list[int] | None = None

    @property
    def answer(self) -> ProcessedImages | ImagesRefused:
        if self.images is not None:
            return self.images
        if self.refused is not None:
            return self.refused
        raise AnswerFramesError(f"the answer to job {self.job} holds neither images nor a refusal")


class AnswerFramesError(ValueError):
    """An answer's frames do not make an answer (a peer of another version, or a bug)."""


_message_encoder = msgspec.msgpack.Encoder()
_message_decoder: msgspec.msgpack.Decoder[PreprocessorMessage] = msgspec.msgpack.Decoder(PreprocessorMessage)  # type: ignore[arg-type]


def encode_message(message: PreprocessorMessage) -> bytes:
    return _message_encoder.encode(message)


def decode_message(data: bytes) -> PreprocessorMessage:
    return _message_decoder.decode(data)


def encode_answer(job: int, answer: ProcessedImages | ImagesRefused) -> list[Any]:
    """The answer's frames: the header, then every array's memory (not copied: the arrays
    themselves, which must stay unchanged until zmq has sent them)."""
    buffers: list[np.ndarray] = []

    def array_ref(value: Any) -> Any:
        if not isinstance(value, np.ndarray):
            raise TypeError(f"cannot encode {type(value).__name__}")
        array = np.ascontiguousarray(value)
        buffers.append(array)
        return [len(buffers), array.dtype.str, list(array.shape)]

    message = JobAnswer(job, images=answer) if isinstance(answer, ProcessedImages) else JobAnswer(job, refused=answer)
    header = msgspec.msgpack.Encoder(enc_hook=array_ref).encode(message)
    return [header, *buffers]


def encode_not_held(jobs: list[int]) -> list[Any]:
    """The frames of the answer to `AskHeldJobs`: `jobs` are held nowhere."""
    return [msgspec.msgpack.encode(JobAnswer(0, not_held=jobs))]


def decode_answer(frames: list[zmq.Frame] | list[bytes]) -> JobAnswer:
    """The answer of these frames (as received, uncopied: each array a read-only view of its frame)."""

    def array_of(kind: type, value: Any) -> Any:
        if kind is not np.ndarray:
            raise TypeError(f"cannot decode {kind}")
        frame, dtype, shape = value
        if not isinstance(frame, int) or not 0 < frame < len(frames):
            raise ValueError(f"an array reference {value!r} names no frame of {len(frames)}")
        memory = frames[frame]
        buffer = memory.buffer if isinstance(memory, zmq.Frame) else memory
        array = np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
        array.flags.writeable = False
        return array

    if not frames:
        raise AnswerFramesError("an answer with no frames")
    header = frames[0].bytes if isinstance(frames[0], zmq.Frame) else frames[0]
    try:
        return msgspec.msgpack.Decoder(JobAnswer, dec_hook=array_of).decode(header)
    except msgspec.DecodeError as exc:  # (a `ValidationError` too: a dtype or shape its frame cannot hold)
        raise AnswerFramesError(str(exc)) from None
