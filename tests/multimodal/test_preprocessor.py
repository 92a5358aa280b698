"""The preprocessor: limits before work, typed errors, and the processed-image cache."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from mmserve.multimodal import ImageBatchRequest, PixelMode, load_image_family
from mmserve.multimodal.errors import ImageInputError
from mmserve.multimodal.preprocessor import ImagePreprocessor, PreprocessorLimits
from mmserve.fetch import FetchPolicy
from serve_app.config import BUILTIN_MODEL_DIR


def _uri(width: int, height: int, seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _preprocessor(cache_bytes: int = 64 * 1024 * 1024, max_images: int = 4) -> ImagePreprocessor:
    family = load_image_family(BUILTIN_MODEL_DIR)
    return ImagePreprocessor(family, FetchPolicy(), PreprocessorLimits(max_images_per_request=max_images), cache_bytes)


def _run(pre: ImagePreprocessor, urls: list[str], mode: PixelMode = PixelMode.DEVICE_NORMALIZE):
    return asyncio.run(pre.process(ImageBatchRequest(urls=urls, pixel_mode=mode, engine_dtype="bfloat16")))


def test_repeated_images_come_from_the_cache_unchanged():
    pre = _preprocessor()
    a, b = _uri(300, 200, 1), _uri(100, 80, 2)
    first = _run(pre, [a, b])
    second = _run(pre, [b, a])
    assert pre.cache.hits == 2 and pre.cache.misses == 2
    assert second.images[0].mm_hash == first.images[1].mm_hash
    assert np.array_equal(second.images[1].fields[0].array, first.images[0].fields[0].array)
    # A different pixel mode is a different entry (different tensors on the wire).
    bf16 = _run(pre, [a], PixelMode.HOST_NORMALIZE)
    assert bf16.images[0].fields[0].dtype == "bfloat16" and pre.cache.misses == 3


def test_cache_is_bounded_by_pixel_bytes():
    pre = _preprocessor(cache_bytes=2_000_000)
    for seed in range(6):
        _run(pre, [_uri(448, 448, seed)])  # 1024 patches x 1176 bytes ≈ 1.2 MB each
    assert pre.cache._bytes <= 2_000_000
    assert len(pre.cache._entries) == 1


def test_too_many_images_refused_before_any_fetch():
    pre = _preprocessor(max_images=2)
    with pytest.raises(ImageInputError, match="at most 2"):
        _run(pre, ["http://never-fetched.invalid/a.png"] * 3)


def test_bad_image_names_its_position():
    pre = _preprocessor()
    with pytest.raises(ImageInputError, match="^image 2: "):
        _run(pre, [_uri(56, 56, 0), "data:image/png;base64," + base64.b64encode(b"not an image").decode()])
