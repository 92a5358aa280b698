"""The engine side of vLLM 0.32's EngineCore wire: decoding requests, encoding outputs.

`mmserve.wire.codec` is the front-end's half (it encodes ADD/ABORT/UTILITY and decodes
outputs). This module is the other half, as `vllm serve --headless` implements it in
`EngineCoreProc.process_input_sockets`/`process_output_sockets` with `MsgpackDecoder`/
`MsgpackEncoder` (vllm/v1/serial_utils.py).

An ADD body is decoded *generically* (plain msgpack → lists/maps) and then interpreted by
position and key, because multimodal field elements and tensors are not msgspec structs:
- `EngineCoreRequest` is an array: request_id, prompt_token_ids, mm_features,
  sampling_params, pooling_params, arrival_time, lora_request, cache_salt,
  data_parallel_rank, prompt_embeds, prompt_is_token_ids, client_index, ...
- a tensor is `[dtype, shape, data]`; data is msgpack ext 3 (raw bytes inline) or the index
  of an out-of-band frame (frame 0 is the body).
- ext types other than 3 (vLLM's pickle/cloudpickle) are refused.

Nothing here imports vllm, torch or transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..wire.codec import EXT_RAW_VIEW
from ..wire.engine_core import ENGINE_CORE_DEAD, EngineCoreOutputs, RequestType
from ..wire.multimodal import TORCH_ITEMSIZE

__all__ = [
    "ENGINE_CORE_DEAD", "WireDecodeError", "ReceivedTensor", "ReceivedFieldElem", "ReceivedFeature",
    "ReceivedSampling", "ReceivedRequest", "decode_add", "decode_abort", "decode_utility",
    "decode_message", "OutputEncoder",
]


class WireDecodeError(ValueError):
    """A front-end message that does not follow the EngineCore wire format."""


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == EXT_RAW_VIEW:
        return data
    raise WireDecodeError(f"refusing msgpack ext type {code} (pickle is never accepted)")


_generic_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def _decode_body(frame: Any) -> Any:
    try:
        return _generic_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireDecodeError(f"undecodable msgpack body: {exc}") from None


# ----------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class ReceivedTensor:
    """A tensor as received: torch dtype name, shape, and its raw little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def as_ints(self) -> list[int]:
        """Integer tensor contents, flattened (small tensors only, e.g. image_grid_thw)."""
        fmt = {"int64": "q", "int32": "i", "int16": "h", "int8": "b", "uint8": "B", "bool": "B"}.get(self.dtype)
        if fmt is None:
            raise WireDecodeError(f"expected an integer tensor, got {self.dtype}")
        return list(self.data.cast("B").cast(fmt)) if self.data.nbytes else []


def _is_tensor(obj: Any) -> bool:
    return (
        isinstance(obj, list)
        and len(obj) == 3
        and isinstance(obj[0], str)
        and isinstance(obj[1], list)
        and isinstance(obj[2], (int, memoryview))
        and not isinstance(obj[2], bool)
    )


def _decode_tensor(obj: Any, frames: list[Any]) -> ReceivedTensor:
    if not _is_tensor(obj):
        raise WireDecodeError(f"not a tensor [dtype, shape, data]: {type(obj).__name__}")
    dtype, shape, data = obj
    itemsize = TORCH_ITEMSIZE.get(dtype)
    if itemsize is None:
        raise WireDecodeError(f"unknown tensor dtype {dtype!r}")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WireDecodeError(f"bad tensor shape {shape!r}")
    if isinstance(data, int):
        if not 0 < data < len(frames):
            raise WireDecodeError(f"tensor refers to out-of-band frame {data}, message has {len(frames)} frames")
        buf = frames[data]
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
    else:
        view = data
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    expected = math.prod(shape) * itemsize
    if view.nbytes != expected:
        raise WireDecodeError(f"tensor {dtype}{tuple(shape)} needs {expected} bytes, got {view.nbytes}")
    return ReceivedTensor(dtype, tuple(shape), view)


def _decode_nested_tensors(obj: Any, frames: list[Any]) -> Any:
    """vLLM's NestedTensors: a tensor, a (nested) list of tensors, or a bare number."""
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return obj
    if _is_tensor(obj):
        return _decode_tensor(obj, frames)
    if isinstance(obj, list):
        return [_decode_nested_tensors(x, frames) for x in obj]
    raise WireDecodeError(f"unexpected multimodal data of type {type(obj).__name__}")


# ----------------------------------------------------------------------------- requests


@dataclass
class ReceivedFieldElem:
    """One `MultiModalFieldElem`: data (tensor / nested / None) and its field factory."""

    data: Any
    factory: str
    kwargs: dict[str, Any]


@dataclass
class ReceivedFeature:
    """One `MultiModalFeatureSpec`."""

    data: dict[str, ReceivedFieldElem] | None
    modality: str
    identifier: str
    offset: int
    length: int
    is_embed: ReceivedTensor | None
    mm_hash: str | None


@dataclass
class ReceivedSampling:
    """The parts of `SamplingParams` the built-in engine acts on (vLLM's defaults)."""

    temperature: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    all_stop_token_ids: set[int] = field(default_factory=set)
    # vLLM's `StructuredOutputsParams` as sent (a map), None without a constraint.
    structured_outputs: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReceivedRequest:
    request_id: str
    prompt_token_ids: list[int]
    mm_features: list[ReceivedFeature]
    sampling: ReceivedSampling | None
    arrival_time: float
    client_index: int = 0
    has_pooling_params: bool = False


def _int(value: Any, what: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireDecodeError(f"{what} must be an int, got {type(value).__name__}")
    return value


def _int_list(value: Any, what: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise WireDecodeError(f"{what} must be a list of ints")
    return value


def _decode_sampling(obj: Any) -> ReceivedSampling | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise WireDecodeError("sampling_params must be a map")
    s = ReceivedSampling(raw=obj)
    if "temperature" in obj:
        t = obj["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise WireDecodeError("temperature must be a number")
        s.temperature = float(t)
    s.seed = _int(obj.get("seed"), "seed", optional=True)
    if "max_tokens" in obj:
        s.max_tokens = _int(obj["max_tokens"], "max_tokens", optional=True)
    s.min_tokens = _int(obj.get("min_tokens", 0), "min_tokens") or 0
    s.ignore_eos = bool(obj.get("ignore_eos", False))
    s.stop_token_ids = _int_list(obj.get("stop_token_ids"), "stop_token_ids")
    s.eos_token_id = _int(obj.get("_eos_token_id"), "_eos_token_id", optional=True)
    # vLLM's SamplingParams.__post_init__ merges stop_token_ids into _all_stop_token_ids on decode.
    s.all_stop_token_ids = set(_int_list(obj.get("_all_stop_token_ids"), "_all_stop_token_ids"))
    s.all_stop_token_ids.update(s.stop_token_ids)
    if s.eos_token_id is not None:
        s.all_stop_token_ids.add(s.eos_token_id)
    structured = obj.get("structured_outputs")
    if structured is not None and not isinstance(structured, dict):
        raise WireDecodeError("structured_outputs must be a map")
    s.structured_outputs = structured
    return s


def _decode_feature(obj: Any, frames: list[Any]) -> ReceivedFeature:
    if not isinstance(obj, dict):
        raise WireDecodeError("a multimodal feature must be a map")
    pos = obj.get("mm_position")
    if not isinstance(pos, dict):
        raise WireDecodeError("multimodal feature without mm_position")
    is_embed = pos.get("is_embed")
    data_obj = obj.get("data")
    data: dict[str, ReceivedFieldElem] | None = None
    if data_obj is not None:
        if not isinstance(data_obj, dict):
            raise WireDecodeError("multimodal item data must be a map")
        data = {}
        for key, elem in data_obj.items():
            if not isinstance(elem, dict) or "field" not in elem:
                raise WireDecodeError(f"multimodal field {key!r} must be {{data, field}}")
            fld = elem["field"]
            if not (isinstance(fld, list) and len(fld) == 2 and isinstance(fld[0], str) and isinstance(fld[1], dict)):
                raise WireDecodeError(f"multimodal field {key!r}: field must be [factory, kwargs]")
            if fld[0] not in ("batched", "flat", "shared"):
                raise WireDecodeError(f"multimodal field {key!r}: unknown factory {fld[0]!r}")
            elem_data = elem.get("data")
            decoded = None if elem_data is None else _decode_nested_tensors(elem_data, frames)
            data[str(key)] = ReceivedFieldElem(decoded, fld[0], fld[1])
    mm_hash = obj.get("mm_hash")
    return ReceivedFeature(
        data=data,
        modality=str(obj.get("modality")),
        identifier=str(obj.get("identifier")),
        offset=_int(pos.get("offset"), "mm_position.offset"),
        length=_int(pos.get("length"), "mm_position.length"),
        is_embed=None if is_embed is None else _decode_tensor(is_embed, frames),
        mm_hash=None if mm_hash is None else str(mm_hash),
    )


def decode_add(frames: list[Any]) -> ReceivedRequest:
    """Decode an ADD message's frames (body first, then out-of-band frames).

    Raises `WireDecodeError` with a message for anything that is not a valid request.
    """
    body = _decode_body(frames[0])
    if not isinstance(body, list) or len(body) < 9:
        raise WireDecodeError("EngineCoreRequest must be an array of at least 9 fields")
    request_id = body[0]
    if not isinstance(request_id, str):
        raise WireDecodeError("request_id must be a string")
    features_obj = body[2] or []
    if not isinstance(features_obj, list):
        raise WireDecodeError("mm_features must be a list")
    arrival = body[5]
    return ReceivedRequest(
        request_id=request_id,
        prompt_token_ids=_int_list(body[1], "prompt_token_ids"),
        mm_features=[_decode_feature(f, frames) for f in features_obj],
        sampling=_decode_sampling(body[3]),
        has_pooling_params=body[4] is not None,
        arrival_time=float(arrival) if isinstance(arrival, (int, float)) else 0.0,
        client_index=(_int(body[11], "client_index") or 0) if len(body) > 11 else 0,
    )


def request_id_of(frame: Any) -> str | None:
    """Best effort: the request id of an ADD body that failed to decode fully."""
    try:
        body = _generic_decoder.decode(frame)
    except Exception:
        return None
    if isinstance(body, list) and body and isinstance(body[0], str):
        return body[0]
    return None


def decode_abort(frames: list[Any]) -> list[str]:
    body = _decode_body(frames[0])
    if not isinstance(body, list) or not all(isinstance(r, str) for r in body):
        raise WireDecodeError("ABORT body must be a list of request ids")
    return body


def decode_utility(frames: list[Any]) -> tuple[int, int, str, list[Any]]:
    body = _decode_body(frames[0])
    if not (isinstance(body, list) and len(body) == 4 and isinstance(body[2], str)):
        raise WireDecodeError("UTILITY body must be [client_index, call_id, method, args]")
    client_index, call_id, method, args = body
    return _int(client_index, "client_index"), _int(call_id, "call_id"), method, list(args or [])


def decode_message(frames: list[Any]) -> tuple[RequestType, Any]:
    """Decode `[type, body, oob...]` as the engine's DEALER receives it (no identity frame)."""
    if len(frames) < 2:
        raise WireDecodeError(f"expected [type, body, ...], got {len(frames)} frame(s)")
    try:
        rtype = RequestType(bytes(frames[0]))
    except ValueError:
        raise WireDecodeError(f"unknown request type {bytes(frames[0])[:8]!r}") from None
    data = list(frames[1:])
    if rtype is RequestType.ADD:
        return rtype, decode_add(data)
    if rtype is RequestType.ABORT:
        return rtype, decode_abort(data)
    if rtype is RequestType.UTILITY:
        return rtype, decode_utility(data)
    return rtype, _decode_body(data[0])


# ----------------------------------------------------------------------------- outputs


class OutputEncoder:
    """Encodes `EngineCoreOutputs` for the output socket (one frame: no tensors are sent)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, outputs: EngineCoreOutputs) -> bytes:
        return self._encoder.encode(outputs)

    def encode_map(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)
