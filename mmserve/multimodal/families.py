"""Model families: how one family's images become engine fields and prompt placeholders.

A family is picked from the model directory's config.json (`model_type`); adding one is a
small class here plus its pixel module in `mmserve.vision`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from ..model_files import ModelFiles
from ..text import MediaPlaceholders
from ..vision import LlavaSettings, PixelDtype, Qwen2VLSettings
from .types import ImageField, PixelMode, ProcessedImage

_DTYPE_BY_ENGINE = {"bfloat16": PixelDtype.BFLOAT16, "float16": PixelDtype.FLOAT16, "float32": PixelDtype.FLOAT32}


# An RGB image: uint8 [H, W, 3], or a decoded RGB PIL image (the faster path with pillow-simd).
RGBImage = np.ndarray | Image.Image


def _size(image: RGBImage) -> tuple[int, int]:
    if isinstance(image, np.ndarray):
        return int(image.shape[1]), int(image.shape[0])
    return image.size


class UnsupportedImageFamily(ValueError):
    """The model directory describes no vision model we can preprocess for."""


def pixel_dtype_for(mode: PixelMode, engine_dtype: str) -> PixelDtype:
    if mode is PixelMode.DEVICE_NORMALIZE:
        return PixelDtype.UINT8
    try:
        return _DTYPE_BY_ENGINE[engine_dtype]
    except KeyError:
        raise UnsupportedImageFamily(f"no pixel dtype for an engine running in {engine_dtype}") from None


class ImageFamily(Protocol):
    name: str
    placeholder_token_id: int
    # The text a "string"-format chat template gets for each image (vLLM's placeholder string).
    chat_placeholders: MediaPlaceholders
    # Whether engines of this family can normalise uint8 pixels themselves.
    supports_device_normalize: bool

    def num_tokens(self, width: int, height: int) -> int: ...

    def process(self, image: RGBImage, dtype: PixelDtype) -> ProcessedImage: ...


@dataclass(frozen=True)
class Qwen2VLFamily:
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL (images): flat `pixel_values` rows + batched `image_grid_thw`."""

    settings: Qwen2VLSettings
    placeholder_token_id: int
    name: str = "qwen2_vl"
    chat_placeholders: MediaPlaceholders = MediaPlaceholders(image="<|vision_start|><|image_pad|><|vision_end|>")
    supports_device_normalize: bool = True

    def num_tokens(self, width: int, height: int) -> int:
        return self.settings.num_image_tokens(width, height)

    def process(self, rgb: RGBImage, dtype: PixelDtype) -> ProcessedImage:
        image = self.settings.process(rgb, dtype)
        width, height = _size(rgb)
        return ProcessedImage(
            fields=[
                ImageField("pixel_values", image.pixel_values, dtype.value, "flat"),
                # vLLM keeps the grid on the CPU: its mRoPE position code reads it there.
                ImageField("image_grid_thw", image.image_grid_thw, "int64", "batched", keep_on_cpu=True),
            ],
            num_tokens=image.num_tokens,
            mm_hash=image.content_hash,
            width=width,
            height=height,
        )


@dataclass(frozen=True)
class LlavaFamily:
    """LLaVA-1.5: one batched, normalised `pixel_values` [3, 336, 336] per image, 576 tokens."""

    settings: LlavaSettings
    placeholder_token_id: int
    name: str = "llava"
    chat_placeholders: MediaPlaceholders = MediaPlaceholders(image="<image>")
    supports_device_normalize: bool = False

    def num_tokens(self, width: int, height: int) -> int:
        return self.settings.num_image_tokens

    def process(self, rgb: RGBImage, dtype: PixelDtype) -> ProcessedImage:
        image = self.settings.process(rgb, dtype)
        width, height = _size(rgb)
        return ProcessedImage(
            fields=[ImageField("pixel_values", image.pixel_values, dtype.value, "batched")],
            num_tokens=image.num_tokens,
            mm_hash=image.content_hash,
            width=width,
            height=height,
        )


def load_image_family(model_dir: str | Path) -> ImageFamily | None:
    """The image family of a model directory, or None for a text-only model."""
    root = Path(model_dir)
    files = ModelFiles.load(root)
    model_type = files.model_config.model_type
    preprocessor = root / "preprocessor_config.json"
    # Qwen3-VL images follow Qwen2-VL's rule: the same processor class (16x16 patches, factor 32 and
    # mean/std 0.5 come from its preprocessor_config.json) and <|image_pad|> x grid / merge².
    if model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        token = files.model_config.token_id("image_token_id")
        if token is None:
            raise UnsupportedImageFamily("config.json names no image_token_id")
        return Qwen2VLFamily(Qwen2VLSettings.from_file(preprocessor), token)
    if model_type == "llava":
        token = files.model_config.token_id("image_token_index") or files.model_config.token_id("image_token_id")
        if token is None:
            raise UnsupportedImageFamily("config.json names no image_token_index")
        patch = files.model_config.vision_patch_size or 14
        return LlavaFamily(LlavaSettings.from_file(preprocessor, patch_size=patch), token)
    return None
