"""LLaVA-1.5 images (CLIP ViT-L/14-336): what vLLM 0.32 sends the engine for one image.

vLLM runs Hugging Face's `CLIPImageProcessor` (torchvision backend): resize so the short edge is 336
and the long edge `int(336 * long / short)` (truncated) with torch's antialiased bicubic, centre-crop
336x336 at `top = int((H - 336) / 2)`, `left = int((W - 336) / 2)`, rescale and normalise in float32,
then cast to the model's dtype. LLaVA has no device-side normalisation: the engine always expects
normalised values. The prompt gets 576 `<image>` tokens (24x24 patches; the CLS token is dropped by
the "default" feature-select strategy).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .hashing import content_hash
from .pixels import Normalization, PixelDtype
from .resize import CropBox, resize_channels

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["LlavaImage", "LlavaSettings"]


@dataclass(frozen=True)
class LlavaSettings:
    """CLIP image processor settings (defaults: llava-hf/llava-1.5-7b-hf's preprocessor_config.json)."""

    shortest_edge: int = 336
    crop_height: int = 336
    crop_width: int = 336
    # The vision tower's patch size is in the model config, not the preprocessor config.
    patch_size: int = 14
    normalization: Normalization = field(default_factory=Normalization)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], patch_size: int = 14) -> LlavaSettings:
        """From a `preprocessor_config.json` mapping (`size` / `crop_size` as dicts or plain ints)."""
        size = config.get("size", 336)
        shortest_edge = size if isinstance(size, int) else size.get("shortest_edge")
        if not isinstance(shortest_edge, int):
            raise ValueError(f"only shortest-edge resizing is supported for LLaVA, got size={size!r}")
        crop = config.get("crop_size", shortest_edge)
        crop_height, crop_width = (crop, crop) if isinstance(crop, int) else (crop["height"], crop["width"])
        if config.get("do_resize", True) is False or config.get("do_center_crop", True) is False:
            raise ValueError("LLaVA preprocessing without resize or centre crop is not supported")
        return cls(
            shortest_edge=int(shortest_edge),
            crop_height=int(crop_height),
            crop_width=int(crop_width),
            patch_size=patch_size,
            normalization=Normalization.from_config(config),
        )

    @classmethod
    def from_file(cls, path: str | Path, patch_size: int = 14) -> LlavaSettings:
        return cls.from_config(json.loads(Path(path).read_text()), patch_size=patch_size)

    @property
    def num_image_tokens(self) -> int:
        """Fixed per image: one token per patch of the crop."""
        return (self.crop_height // self.patch_size) * (self.crop_width // self.patch_size)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) with the short edge at `shortest_edge`, the long one truncated, as HF does."""
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def process(self, rgb: np.ndarray | Image.Image, dtype: PixelDtype = PixelDtype.BFLOAT16) -> LlavaImage:
        """RGB uint8 [H, W, 3] (or an RGB PIL image, see `image_io.decode_image`) -> normalised
        `pixel_values` [3, crop_h, crop_w] in `dtype`."""
        if dtype is PixelDtype.UINT8:
            raise ValueError("LLaVA engines expect normalised pixels; uint8 is not a valid LLaVA dtype")
        height, width = rgb.shape[:2] if isinstance(rgb, np.ndarray) else rgb.size[::-1]
        resized_h, resized_w = self.resized_size(width, height)
        if resized_h < self.crop_height or resized_w < self.crop_width:
            # HF would pad; with a short edge >= the crop this cannot happen for the shipped configs.
            raise ValueError(f"resized {resized_w}x{resized_h} is smaller than the crop; padding is not supported")
        crop = CropBox(
            top=int((resized_h - self.crop_height) / 2.0),
            left=int((resized_w - self.crop_width) / 2.0),
            height=self.crop_height,
            width=self.crop_width,
        )
        planes = resize_channels(rgb, resized_h, resized_w, crop)  # 3 x uint8 [crop_h, crop_w]
        values = self.normalization.lookup(planes, dtype)  # exact: see pixels
        return LlavaImage(
            pixel_values=np.stack(values),
            num_tokens=self.num_image_tokens,
            dtype=dtype,
            _settings=self,
            _cropped=planes,
        )


@dataclass(frozen=True)
class LlavaImage:
    """One processed image: `pixel_values` C-contiguous [3, crop_h, crop_w], channels first, in `dtype`
    (float32, float16, or uint16 holding bfloat16 bit patterns for `PixelDtype.BFLOAT16`)."""

    pixel_values: np.ndarray
    num_tokens: int
    dtype: PixelDtype
    _settings: LlavaSettings = field(repr=False, compare=False)
    _cropped: tuple[np.ndarray, ...] = field(repr=False, compare=False)  # 3 x uint8 [h, w]: what the hash covers

    @functools.cached_property
    def content_hash(self) -> str:
        """The engine's `mm_hash` / `identifier` for this image (SHA-256 hex, see `hashing`)."""
        return content_hash(
            family="llava", settings=repr(self._settings), output_dtype=self.dtype.value, pixels=self._cropped
        )
