"""Multimodal items inside an ADD request.

Mirrors `vllm.multimodal.inputs` of vLLM 0.32: `MultiModalFeatureSpec` (a dataclass: a msgpack
map), `PlaceholderRange` (map), and the serialized form of a `MultiModalKwargsItem`, which
vLLM's `MsgpackEncoder._encode_mm_item` writes as `{key: {"data": tensor, "field": [factory,
kwargs]}}`. The engine rebuilds each field by calling `MultiModalFieldConfig.<factory>("",
**kwargs)`, so the factory names and keyword names below are the contract.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

# torch dtype names (what vLLM writes for tensors) for the numpy dtypes we send.
# bfloat16 has no numpy dtype: it travels as its uint16 bit pattern, labelled "bfloat16".
_TORCH_DTYPE_BY_NUMPY = {
    np.dtype(np.uint8): "uint8",
    np.dtype(np.int8): "int8",
    np.dtype(np.int16): "int16",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
    np.dtype(np.bool_): "bool",
}
# The other way, for tensors the engine sends back (bfloat16 excepted: none of them is).
NUMPY_DTYPE_BY_TORCH = {name: dtype for dtype, name in _TORCH_DTYPE_BY_NUMPY.items()}
TORCH_ITEMSIZE = {
    "uint8": 1, "int8": 1, "bool": 1, "int16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "float32": 4, "int64": 8, "float64": 8,
}


class WireTensor:
    """A torch tensor as vLLM encodes it: `[dtype name, shape, data]`.

    Holds a C-contiguous numpy array (possibly a read-only view of Ray object-store memory)
    and never copies it: the codec hands `array` itself to ZMQ as an out-of-band frame.
    """

    __slots__ = ("array", "dtype", "shape")

    def __init__(self, array: np.ndarray, dtype: str | None = None) -> None:
        if not array.flags.c_contiguous:
            raise ValueError("WireTensor needs a C-contiguous array (it is sent without copying)")
        if dtype is None:
            dtype = _TORCH_DTYPE_BY_NUMPY.get(array.dtype)
            if dtype is None:
                raise ValueError(f"no torch dtype for numpy dtype {array.dtype}")
        elif dtype == "bfloat16" and array.dtype != np.uint16:
            raise ValueError("bfloat16 tensors must be given as uint16 bit patterns")
        if array.itemsize != TORCH_ITEMSIZE.get(dtype, -1):
            raise ValueError(f"itemsize {array.itemsize} does not match dtype {dtype}")
        self.array = array
        self.dtype = dtype
        self.shape = tuple(int(d) for d in array.shape)

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def __repr__(self) -> str:
        return f"WireTensor({self.dtype}, {self.shape})"


class BatchedField:
    """Mirrors `MultiModalBatchedField` (factory `batched`): one item = one tensor."""

    __slots__ = ("keep_on_cpu",)

    def __init__(self, *, keep_on_cpu: bool = False) -> None:
        self.keep_on_cpu = keep_on_cpu

    def wire(self) -> tuple[str, dict[str, Any]]:
        return "batched", {"keep_on_cpu": self.keep_on_cpu}


class FlatField:
    """Mirrors `MultiModalFlatField` (factory `flat`): the item is `slices` of a flat tensor.

    `slices` holds per-dimension `(start, stop, step)` triples: `[[(0, N, None)]]` selects
    rows 0..N along `dim` (three levels of nesting on the wire, as vLLM writes them).
    """

    __slots__ = ("slices", "dim", "keep_on_cpu")

    def __init__(
        self,
        slices: list[list[tuple[int | None, int | None, int | None]]],
        *,
        dim: int = 0,
        keep_on_cpu: bool = False,
    ) -> None:
        self.slices = slices
        self.dim = dim
        self.keep_on_cpu = keep_on_cpu

    def wire(self) -> tuple[str, dict[str, Any]]:
        return "flat", {"keep_on_cpu": self.keep_on_cpu, "slices": self.slices, "dim": self.dim}


class SharedField:
    """Mirrors `MultiModalSharedField` (factory `shared`): one tensor shared by a batch."""

    __slots__ = ("batch_size", "keep_on_cpu")

    def __init__(self, batch_size: int, *, keep_on_cpu: bool = False) -> None:
        self.batch_size = batch_size
        self.keep_on_cpu = keep_on_cpu

    def wire(self) -> tuple[str, dict[str, Any]]:
        return "shared", {"keep_on_cpu": self.keep_on_cpu, "batch_size": self.batch_size}


FieldConfig = BatchedField | FlatField | SharedField


class FieldElem:
    """Mirrors `MultiModalFieldElem`: one keyword argument of one item.

    Written by the codec as `{"data": tensor | None, "field": [factory, kwargs]}`; `data` is
    None when the engine already caches the item (sent by hash only).
    """

    __slots__ = ("data", "field")

    def __init__(self, data: WireTensor | None, field: FieldConfig) -> None:
        self.data = data
        self.field = field


class PlaceholderRange(msgspec.Struct):
    """Mirrors `PlaceholderRange`: where an item's tokens sit in the prompt."""

    offset: int
    length: int
    # Boolean mask (length,) of positions that take embeddings; None = all of them.
    is_embed: WireTensor | None = None


class MultiModalFeatureSpec(msgspec.Struct):
    """Mirrors `MultiModalFeatureSpec`: one image (or other item) of a request."""

    data: dict[str, FieldElem] | None
    modality: Literal["image", "video", "audio"]
    # Keys the engine's encoder cache; must always mean the same processed pixels.
    identifier: str
    mm_position: PlaceholderRange
    # Keys the engine's processor (receiver) cache.
    mm_hash: str | None = None
