"""Encoding front-end → engine messages and decoding engine → front-end messages.

Follows vLLM 0.32's `MsgpackEncoder`/`MsgpackDecoder` (vllm/v1/serial_utils.py):
- a tensor is `[dtype, shape, data]`; `data` is msgpack ext type 3 holding the raw bytes when
  the tensor is under `OOB_THRESHOLD` bytes, else the index of an out-of-band frame (frame 0
  is the msgpack body). Large tensors are never copied into the body: the frame list holds
  the caller's arrays themselves, for ZMQ to send with `copy=False`.
- never pickle: no ext types other than 3 are written or accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from .engine_core import ENGINE_CORE_DEAD, EngineCoreOutputs, EngineCoreRequest, OutputTensor, RequestType, WireArray
from .handshake import EngineStatusMessage, HandshakeInit, ReadyResponse
from .multimodal import BatchedField, FieldElem, FlatField, SharedField, WireTensor

# vLLM's default VLLM_MSGPACK_ZERO_COPY_THRESHOLD.
OOB_THRESHOLD = 256
# vLLM's CUSTOM_TYPE_RAW_VIEW: raw tensor bytes inline in the body.
EXT_RAW_VIEW = 3

Frame = bytes | memoryview | np.ndarray


class EngineDeadMessage(Exception):
    """The engine announced its own death (`ENGINE_CORE_DEAD`)."""


class RequestEncoder:
    """Encodes ADD, ABORT and UTILITY messages into ZMQ frame lists (type frame first).

    Not thread-safe (the out-of-band frame list is per call), like vLLM's encoder.
    """

    def __init__(self, oob_threshold: int = OOB_THRESHOLD) -> None:
        self._oob_threshold = oob_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Frame] | None = None

    def encode_add(self, request: EngineCoreRequest) -> list[Frame]:
        return [RequestType.ADD.value, *self._encode_with_frames(request)]

    def encode_abort(self, request_ids: Sequence[str]) -> list[Frame]:
        return [RequestType.ABORT.value, self._encoder.encode(list(request_ids))]

    def encode_utility(self, client_index: int, call_id: int, method: str, args: Sequence[Any]) -> list[Frame]:
        body = self._encoder.encode([client_index, call_id, method, list(args)])
        return [RequestType.UTILITY.value, body]

    def _encode_with_frames(self, obj: Any) -> list[Frame]:
        self._frames = frames = [b""]
        try:
            frames[0] = self._encoder.encode(obj)
            return frames
        finally:
            self._frames = None

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, WireTensor):
            return self._encode_tensor(obj)
        if isinstance(obj, FieldElem):
            return {"data": obj.data, "field": obj.field.wire()}
        if isinstance(obj, (BatchedField, FlatField, SharedField)):
            return obj.wire()
        raise TypeError(f"cannot encode {type(obj).__name__} for the engine")

    def _encode_tensor(self, tensor: WireTensor) -> tuple[str, tuple[int, ...], Any]:
        assert self._frames is not None, "tensors only travel inside ADD requests"
        array = tensor.array
        if array.nbytes < self._oob_threshold:
            data: Any = msgspec.msgpack.Ext(EXT_RAW_VIEW, array.tobytes())
        else:
            data = len(self._frames)
            # The array itself, not a copy: ZMQ sends it with copy=False and keeps a
            # reference until the kernel is done with it.
            self._frames.append(array)
        return tensor.dtype, tensor.shape, data


def _reject_ext(code: int, data: memoryview) -> Any:
    if code == EXT_RAW_VIEW:
        return data
    raise ValueError(f"refusing msgpack ext type {code} from the engine (pickle is never accepted)")


class OutputDecoder:
    """Decodes the engine's output-socket messages into `EngineCoreOutputs`."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs, ext_hook=_reject_ext)

    def decode(self, frames: Sequence[bytes | memoryview]) -> EngineCoreOutputs:
        """Raises `EngineDeadMessage` for ENGINE_CORE_DEAD, `msgspec.DecodeError` for garbage."""
        first = frames[0]
        if len(frames) == 1 and bytes(first) == ENGINE_CORE_DEAD:
            raise EngineDeadMessage("engine sent ENGINE_CORE_DEAD")
        outputs = self._decoder.decode(first)
        for output in outputs.outputs:
            if output.new_logprobs is not None:
                lists = output.new_logprobs
                _resolve_frames((lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks), frames)
            if output.new_prompt_logprobs_tensors is not None:
                tensors = output.new_prompt_logprobs_tensors
                _resolve_frames((tensors.logprob_token_ids, tensors.logprobs, tensors.selected_token_ranks), frames)
        return outputs


def _resolve_frames(arrays: tuple[WireArray | OutputTensor, ...], frames: Sequence[bytes | memoryview]) -> None:
    """Each array's data as bytes of its own: the out-of-band frame it names (arrays of
    `OOB_THRESHOLD` bytes or more), or a copy of its inline view (the frame is reused)."""
    for array in arrays:
        array.data = bytes(frames[array.data]) if isinstance(array.data, int) else bytes(array.data)


_status_decoder = msgspec.msgpack.Decoder(EngineStatusMessage)
_ready_decoder = msgspec.msgpack.Decoder(ReadyResponse)


def decode_status(data: bytes) -> EngineStatusMessage:
    return _status_decoder.decode(data)


def decode_ready_response(data: bytes) -> ReadyResponse:
    return _ready_decoder.decode(data)


def encode_handshake_init(init: HandshakeInit) -> bytes:
    return msgspec.msgpack.encode(init)

