"""Pixel value arithmetic shared by the model families: normalise like torch, cast like torch.

Both steps reproduce what Hugging Face's torchvision-backend processors do, bit for bit:

- rescale + normalise are fused there (`TorchvisionBackend._fuse_mean_std_and_rescale_factor`): the
  mean and std become float32 tensors multiplied by `1 / rescale_factor`, and each value is
  `(float32(x) - mean') / std'` in float32 — not `(x / 255 - mean) / std`, which rounds differently;
- the cast to the engine's dtype is torch's `.to(dtype)`: round to nearest, ties to even, for float16
  and bfloat16 alike. numpy has no bfloat16, so bfloat16 values are carried as their uint16 bit
  patterns (the bytes the engine expects on the wire).

How it is computed: the input is uint8, so per channel there are only 256 possible results. They are
computed once per (settings, dtype) with the exact elementwise arithmetic above (`Normalization.apply`
then `cast_float32`) into a lookup table, and images are mapped through it (`Normalization.lookup`):
byte-identical by construction, and one gather instead of ~10 passes of float arithmetic. The gather
reads two pixels at a time (a uint16 index into a 65,536-entry table of value pairs), which halves the
index traffic numpy's `take` spends on its index conversion.
"""

from __future__ import annotations

import enum
import functools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Normalization", "PixelDtype", "cast_float32", "lookup_tables"]


class PixelDtype(enum.Enum):
    """The dtype of the pixel values sent to the engine; the value is torch's name, used on the wire."""

    UINT8 = "uint8"  # resized, unnormalised pixels: the engine normalises on the device
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"  # numpy arrays hold the raw bit patterns as uint16

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(_NUMPY_CARRIER[self])


_NUMPY_CARRIER = {
    PixelDtype.UINT8: np.uint8,
    PixelDtype.FLOAT32: np.float32,
    PixelDtype.FLOAT16: np.float16,
    PixelDtype.BFLOAT16: np.uint16,
}


@dataclass(frozen=True)
class Normalization:
    """A processor's `do_rescale`/`rescale_factor`/`do_normalize`/`image_mean`/`image_std`."""

    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD

    def apply(self, planes: np.ndarray) -> np.ndarray:
        """planes [3, H, W] (uint8) -> float32 model values, as `TorchvisionBackend.rescale_and_normalize`."""
        if self.do_normalize:
            mean, std = self._fused_mean_std()
            result = np.subtract(planes, mean.reshape(-1, 1, 1), dtype=np.float32)
            np.divide(result, std.reshape(-1, 1, 1), out=result)
            return result
        result = planes.astype(np.float32)
        if self.do_rescale:
            # torch: uint8 tensor * Python float -> float32 tensor times the factor rounded to float32.
            result *= np.float32(self.rescale_factor)
        return result

    def lookup(self, planes: Sequence[np.ndarray], dtype: PixelDtype) -> list[np.ndarray]:
        """uint8 planes (one [H, W] array per channel) -> C-contiguous planes in `dtype`'s numpy carrier.

        Exactly `cast_float32(self.apply(np.stack(planes)), dtype)`, channel by channel.
        """
        if len(planes) != 3:
            raise ValueError(f"expected 3 channel planes, got {len(planes)}")
        single, pairs = lookup_tables(self, dtype)
        carrier = dtype.numpy_dtype
        result = []
        for channel, plane in enumerate(planes):
            if plane.dtype != np.uint8:
                raise ValueError(f"expected uint8 planes, got {plane.dtype}")
            out = np.empty(plane.shape, dtype=carrier)
            if pairs is not None and plane.ndim == 2 and plane.shape[-1] % 2 == 0 and plane.size:
                # Two neighbouring pixels as one little-endian uint16 index -> their two values at once.
                index = np.ascontiguousarray(plane).view(np.uint16)
                np.take(pairs[channel], index, out=out.view(pairs.dtype), mode="clip")
            else:
                np.take(single[channel], plane, out=out, mode="clip")
            result.append(out)
        return result

    def _fused_mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel float32 (mean', std') such that the value is (float32(x) - mean') / std'.

        With rescaling, torch computes `float32_tensor(mean) * (1.0 / rescale_factor)`: the Python
        double `1 / (1/255)` is rounded to float32 (255.0) and the product is a float32 multiplication.
        """
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        if self.do_rescale:
            factor = np.float32(1.0 / self.rescale_factor)
            mean, std = mean * factor, std * factor
        return mean, std

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Normalization:
        """From a `preprocessor_config.json` mapping; missing keys take the CLIP defaults HF uses."""
        defaults = cls()
        return cls(
            do_rescale=bool(config.get("do_rescale", defaults.do_rescale)),
            rescale_factor=float(config.get("rescale_factor", defaults.rescale_factor)),
            do_normalize=bool(config.get("do_normalize", defaults.do_normalize)),
            image_mean=_three_floats(config.get("image_mean", defaults.image_mean)),
            image_std=_three_floats(config.get("image_std", defaults.image_std)),
        )


@functools.lru_cache(maxsize=32)
def lookup_tables(normalization: Normalization, dtype: PixelDtype) -> tuple[np.ndarray, np.ndarray | None]:
    """Per channel, every uint8 value's result in `dtype`'s carrier: `single` [3, 256], and `pairs`
    [3, 65536] of twice-as-wide unsigned ints holding the results for (lo, hi) at index `lo + 256 * hi`
    in little-endian order (None on big-endian machines). Read-only, cached per (settings, dtype).
    """
    if dtype is PixelDtype.UINT8:
        raise ValueError("uint8 pixels are not normalised")
    values = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256)).copy()
    single = np.ascontiguousarray(cast_float32(normalization.apply(values), dtype).reshape(3, 256))
    single.flags.writeable = False
    if sys.byteorder != "little":
        return single, None
    width = single.dtype.itemsize
    bits = single.view({2: np.uint16, 4: np.uint32}[width]).astype({2: np.uint32, 4: np.uint64}[width])
    # pairs[c, hi, lo] = bits[c, lo] | bits[c, hi] << (8 * width)
    pairs = bits[:, None, :] | (bits[:, :, None] << bits.dtype.type(8 * width))
    pairs = np.ascontiguousarray(pairs.reshape(3, 256 * 256))
    pairs.flags.writeable = False
    return single, pairs


def _three_floats(value: Any) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    values = tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"expected 3 per-channel values, got {value!r}")
    return values  # type: ignore[return-value]


def cast_float32(values: np.ndarray, dtype: PixelDtype) -> np.ndarray:
    """Cast float32 values to the engine dtype exactly as torch's `.to(dtype)` does."""
    if values.dtype != np.float32:
        raise ValueError(f"expected float32 values, got {values.dtype}")
    if dtype is PixelDtype.FLOAT32:
        return values
    if dtype is PixelDtype.FLOAT16:
        return values.astype(np.float16)  # IEEE round-to-nearest-even, as torch
    if dtype is PixelDtype.BFLOAT16:
        return _bfloat16_bits(values)
    raise ValueError(f"cannot cast normalised pixels to {dtype.value}")


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (c10's `round_to_nearest_even`).

    Keep the top 16 bits after adding 0x7FFF plus the lowest kept bit: ties go to the even pattern.
    NaN is kept a (quiet) NaN, as torch does; normalised pixels are never NaN, but be safe.
    """
    bits = np.ascontiguousarray(values).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    result = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        result[nan] = np.uint16(0x7FC0)
    return result
