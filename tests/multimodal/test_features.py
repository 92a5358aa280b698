"""Placeholder expansion: each image's one placeholder token becomes its token range and feature spec."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.multimodal import ImageField, PlaceholderMismatch, ProcessedImage, ProcessedImages, attach_images, expand_image_placeholders
from mmserve.wire import EngineCoreRequest, SamplingParams

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


def test_attach_images_sets_the_expanded_prompt_and_features():
    images = ProcessedImages([_image(2, "a")], placeholder_token_id=PAD, family="qwen2_vl")
    request = EngineCoreRequest("r", [1, PAD, 2], None, SamplingParams(max_tokens=3), None, 0.0, None, None, None)
    attached = attach_images(request, images)
    assert attached.prompt_token_ids == [1, PAD, PAD, 2]
    assert [(f.mm_position.offset, f.mm_position.length) for f in attached.mm_features] == [(1, 2)]
    assert attached.sampling_params == request.sampling_params


def test_an_image_takes_at_least_one_token():
    images = ProcessedImages([_image(0, "a")], placeholder_token_id=PAD, family="qwen2_vl")
    with pytest.raises(PlaceholderMismatch, match="at least one token"):
        expand_image_placeholders([1, PAD], images)
