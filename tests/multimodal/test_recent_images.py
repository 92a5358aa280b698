"""`RecentImages`: what preprocessors answered for data-URI images, recalled without pixels."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.multimodal import ImageBatchRequest, ImageField, PixelMode, ProcessedImage, ProcessedImages
from mmserve.multimodal.recent_images import RecentImages

A, B = "data:image/png;base64,AAAA", "data:image/png;base64,BBBB"


def _request(*urls: str, dtype: str = "bfloat16", mode: PixelMode = PixelMode.DEVICE_NORMALIZE) -> ImageBatchRequest:
    return ImageBatchRequest(list(urls), mode, dtype)


def _answer(*hashes: str) -> ProcessedImages:
    field = ImageField("pixel_values", np.zeros((4, 8), dtype=np.uint8), "uint8", "flat")
    images = [ProcessedImage([field], num_tokens=3 + i, mm_hash=h, width=10, height=20) for i, h in enumerate(hashes)]
    return ProcessedImages(images, placeholder_token_id=151655, family="qwen2_vl", preprocess_ms=4.0)


def test_a_remembered_request_is_recalled_without_pixels():
    recent = RecentImages()
    keys = recent.keys("pre", _request(A, B))
    assert keys is not None and recent.recall(keys) is None
    recent.remember(keys, _answer("h1", "h2"))
    recalled = recent.recall(recent.keys("pre", _request(A, B)))
    assert recalled is not None
    assert [(i.mm_hash, i.num_tokens, i.fields) for i in recalled.images] == [("h1", 3, []), ("h2", 4, [])]
    assert (recalled.placeholder_token_id, recalled.family, recalled.preprocess_ms) == (151655, "qwen2_vl", 0.0)
    # Any order, repeats: each image by its own key.
    again = recent.recall(recent.keys("pre", _request(B, A, B)))
    assert again is not None and [i.mm_hash for i in again.images] == ["h2", "h1", "h2"]


def test_only_data_uris_and_only_the_same_preprocessor_mode_and_dtype():
    recent = RecentImages()
    assert recent.keys("pre", _request(A, "https://example.com/a.png")) is None  # what a URL serves may change
    recent.remember(recent.keys("pre", _request(A)), _answer("h1"))
    assert recent.recall(recent.keys("other", _request(A))) is None  # another preprocessor, or its settings' version
    assert recent.recall(recent.keys("pre", _request(A, dtype="float32"))) is None
    assert recent.recall(recent.keys("pre", _request(A, mode=PixelMode.HOST_NORMALIZE))) is None
    assert recent.recall(recent.keys("pre", _request(A, B))) is None  # one image not seen: none recalled


def test_least_recently_used_images_go_first():
    recent = RecentImages(max_entries=2)
    urls = [f"data:image/png;base64,{i}" for i in range(3)]
    for i, url in enumerate(urls[:2]):
        recent.remember(recent.keys("pre", _request(url)), _answer(f"h{i}"))
    assert recent.recall(recent.keys("pre", _request(urls[0]))) is not None  # now the most recent
    recent.remember(recent.keys("pre", _request(urls[2])), _answer("h2"))
    assert len(recent) == 2
    assert recent.recall(recent.keys("pre", _request(urls[1]))) is None
    assert recent.recall(recent.keys("pre", _request(urls[0]))) is not None
    with pytest.raises(ValueError):
        RecentImages(max_entries=0)
