"""Qwen2-VL and Qwen2.5-VL images: what vLLM 0.32 sends the engine for one image.

vLLM runs Hugging Face's `Qwen2VLImageProcessor` (torchvision backend; Qwen2.5-VL uses the same class):
`smart_resize` picks a size whose sides are multiples of patch_size * merge_size (28) with a pixel count
in [min_pixels, max_pixels]; the image is resized with torch's antialiased bicubic; then cut into
14x14 patches, each repeated temporal_patch_size (2) times, in the order the vision tower merges them.

Two pixel modes, because an engine may run either way and sending the wrong one raises no error:
- `PixelDtype.UINT8` — vLLM 0.32's default (`mm_device_do_normalize`): the processor runs with
  rescale and normalize off and the engine normalises on the device;
- float (`--no-mm-device-do-normalize`): rescaled and normalised in float32, then cast to the
  model's dtype (float32, float16, or bfloat16 carried as uint16 bit patterns).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .hashing import content_hash
from .pixels import Normalization, PixelDtype
from .resize import resize_channels

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["Qwen2VLImage", "Qwen2VLSettings", "smart_resize"]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Hugging Face's `smart_resize`, line for line: (height, width) multiples of `factor`, aspect kept.

    Python's `round` (half to even) is part of the contract, as are the float divisions.
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLSettings:
    """The image processor settings that decide the pixels (defaults: Hugging Face's class defaults)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    normalization: Normalization = field(default_factory=Normalization)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Qwen2VLSettings:
        """From a `preprocessor_config.json` mapping, resolving sizes as `Qwen2VLImageProcessor.__init__`.

        Newer configs say `size: {shortest_edge, longest_edge}` (pixel counts, despite the names);
        older ones say top-level `min_pixels` / `max_pixels`, which win when both are present.
        """
        defaults = cls()
        size = dict(config.get("size") or {"shortest_edge": defaults.min_pixels, "longest_edge": defaults.max_pixels})
        if config.get("min_pixels") is not None:
            size["shortest_edge"] = config["min_pixels"]
        if config.get("max_pixels") is not None:
            size["longest_edge"] = config["max_pixels"]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise ValueError(f"Qwen2-VL size must give shortest_edge and longest_edge (pixel counts), got {size}")
        return cls(
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            patch_size=int(config.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(config.get("temporal_patch_size", defaults.temporal_patch_size)),
            merge_size=int(config.get("merge_size", defaults.merge_size)),
            normalization=Normalization.from_config(config),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Qwen2VLSettings:
        return cls.from_config(json.loads(Path(path).read_text()))

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) after `smart_resize`."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def num_image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens for an image of this (displayed) size — from the header, no pixels needed."""
        resized_h, resized_w = self.resized_size(width, height)
        return (resized_h // self.patch_size) * (resized_w // self.patch_size) // (self.merge_size**2)

    def process(self, rgb: np.ndarray | Image.Image, dtype: PixelDtype = PixelDtype.UINT8) -> Qwen2VLImage:
        """RGB uint8 [H, W, 3] (or an RGB PIL image, see `image_io.decode_image`) -> the engine's
        `pixel_values` and `image_grid_thw` for one image.

        Per image: resize into three channel planes (`resize_channels`), map them through the
        normalisation lookup table unless uint8, then one strided copy into the patch layout.
        """
        height, width = rgb.shape[:2] if isinstance(rgb, np.ndarray) else rgb.size[::-1]
        resized_h, resized_w = self.resized_size(width, height)
        planes = resize_channels(rgb, resized_h, resized_w)  # 3 x uint8 [h, w], C-contiguous
        values = planes if dtype is PixelDtype.UINT8 else self.normalization.lookup(planes, dtype)
        grid_h, grid_w = resized_h // self.patch_size, resized_w // self.patch_size
        return Qwen2VLImage(
            pixel_values=self._patchify_planes(values),
            image_grid_thw=np.array([1, grid_h, grid_w], dtype=np.int64),
            num_tokens=grid_h * grid_w // (self.merge_size**2),
            dtype=dtype,
            _settings=self,
            _resized=planes,
        )

    def _patchify_planes(self, planes: Sequence[np.ndarray]) -> np.ndarray:
        """C planes [H, W] -> [grid_h * grid_w, C * T * p * p] in the processor's order, one copy.

        Rows go merge-window by merge-window (grid_h/m, grid_w/m, m, m); each row is channel, temporal
        copy, patch row, patch column — the single frame repeated T times, as the processor expands it.

        A patch row (p contiguous values) is moved as one opaque `void` element: numpy's strided copy then
        loops over whole patch rows instead of calling its inner loop once per p-value run.
        """
        channels = len(planes)
        height, width = planes[0].shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        dtype = planes[0].dtype
        row = np.dtype((np.void, p * dtype.itemsize))  # one patch row
        out = np.empty((grid_h * grid_w, channels, t, p, p), dtype=dtype)
        # (gh/m, gw/m, m, m, C, T, p) patch rows; the view drops the trailing axis of one element.
        out_rows = out.view(row).reshape(grid_h // m, grid_w // m, m, m, channels, t, p)
        for channel, plane in enumerate(planes):
            rows = np.ascontiguousarray(plane).view(row)  # [H, W / p]
            blocks = rows.reshape(grid_h // m, m, p, grid_w // m, m).transpose(0, 3, 1, 4, 2)  # (gh/m, gw/m, m, m, p)
            out_rows[:, :, :, :, channel] = blocks[:, :, :, :, None, :]  # broadcast over the temporal copies
        return out.reshape(grid_h * grid_w, channels * t * p * p)


@dataclass(frozen=True)
class Qwen2VLImage:
    """One processed image, as the engine receives it.

    `pixel_values` is C-contiguous [grid_t * grid_h * grid_w, 3 * T * p * p] (1176 wide by default)
    in `dtype`: uint8, float32, float16, or — for `PixelDtype.BFLOAT16` — uint16 holding bfloat16 bit
    patterns. `image_grid_thw` is int64 [3]. `num_tokens` image-pad tokens go into the prompt.
    """

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    num_tokens: int
    dtype: PixelDtype
    _settings: Qwen2VLSettings = field(repr=False, compare=False)
    _resized: tuple[np.ndarray, ...] = field(repr=False, compare=False)  # 3 x uint8 [h, w]: what the hash covers

    @functools.cached_property
    def content_hash(self) -> str:
        """The engine's `mm_hash` / `identifier` for this image (SHA-256 hex, see `hashing`)."""
        return content_hash(
            family="qwen2_vl", settings=repr(self._settings), output_dtype=self.dtype.value, pixels=self._resized
        )
