"""Placeholder expansion and the checks that keep inconsistent features away from the engine."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.multimodal import ImageField, PlaceholderMismatch, ProcessedImage, ProcessedImages, expand_image_placeholders
from mmserve.multimodal.features import check_features

PAD = 99


def _image(tokens: int, tag: str) -> ProcessedImage:
    rows = tokens * 4
    return ProcessedImage(
        fields=[
            ImageField("pixel_values", np.zeros((rows, 1176), np.uint8), "uint8", "flat"),
            ImageField("image_grid_thw", np.array([1, 2, rows // 2], np.int64), "int64", "batched", keep_on_cpu=True),
        ],
        num_tokens=tokens, mm_hash=tag * 64, width=56, height=56,
    )


def test_expands_each_placeholder_in_order():
    images = ProcessedImages([_image(3, "a"), _image(2, "b")], placeholder_token_id=PAD, family="qwen2_vl")
    prompt, features = expand_image_placeholders([1, PAD, 2, 3, PAD, 4], images)
    assert prompt == [1, PAD, PAD, PAD, 2, 3, PAD, PAD, 4]
    assert [(f.mm_position.offset, f.mm_position.length) for f in features] == [(1, 3), (6, 2)]
    assert features[0].identifier == features[0].mm_hash == "a" * 64
    flat = features[0].data["pixel_values"].field
    assert flat.wire() == ("flat", {"keep_on_cpu": False, "slices": [[(0, 12, None)]], "dim": 0})
    assert features[0].data["image_grid_thw"].field.wire() == ("batched", {"keep_on_cpu": True})


@pytest.mark.parametrize("prompt", [[1, 2], [PAD, PAD, PAD]])
def test_placeholder_count_must_match_images(prompt):
    images = ProcessedImages([_image(2, "a"), _image(2, "b")], placeholder_token_id=PAD, family="qwen2_vl")
    with pytest.raises(PlaceholderMismatch, match="placeholders"):
        expand_image_placeholders(prompt, images)


def test_checks_refuse_out_of_bounds_overlap_and_wrong_tokens():
    images = ProcessedImages([_image(2, "a")], placeholder_token_id=PAD, family="qwen2_vl")
    prompt, features = expand_image_placeholders([1, PAD, 2], images)
    check_features(prompt, features, PAD)
    with pytest.raises(PlaceholderMismatch):
        check_features(prompt[:2], features, PAD)  # range runs past the end
    with pytest.raises(PlaceholderMismatch):
        check_features([1, PAD, 5, 2], features, PAD)  # covers a non-placeholder token
    with pytest.raises(PlaceholderMismatch):
        check_features(prompt + [PAD], features, PAD)  # a stray placeholder outside every range
    with pytest.raises(PlaceholderMismatch):
        check_features(prompt, features + features, PAD)  # overlapping ranges
