"""The engine client's last check: nothing that would crash a vLLM engine gets through."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.engine import InvalidRequestError, admit
from mmserve.wire import BatchedField, EngineCoreRequest, FieldElem, MultiModalFeatureSpec, PlaceholderRange, SamplingParams, WireTensor

PAD = 99


def _request(prompt: list[int], features=None, **sampling) -> EngineCoreRequest:
    return EngineCoreRequest("r", prompt, features, SamplingParams(**sampling), None, 0.0, None, None, None)


def _feature(offset: int, length: int, array: np.ndarray | None = None, shape=None) -> MultiModalFeatureSpec:
    array = np.zeros((length, 4), np.uint8) if array is None else array
    tensor = WireTensor(array, "uint8")
    if shape is not None:
        tensor.shape = shape  # a tensor whose declared shape does not match its bytes
    return MultiModalFeatureSpec(
        data={"pixel_values": FieldElem(tensor, BatchedField())}, modality="image", identifier="x" * 64,
        mm_position=PlaceholderRange(offset=offset, length=length), mm_hash="x" * 64,
    )


def test_fills_max_tokens_with_what_is_left_of_the_context():
    admitted = admit(_request([1] * 10, max_tokens=None), max_model_len=64)
    assert admitted.sampling_params.max_tokens == 54


@pytest.mark.parametrize(
    ("prompt_len", "sampling", "match"),
    [
        (64, {"max_tokens": None}, "maximum context length"),
        (70, {"max_tokens": 1}, "maximum context length"),
        (10, {"max_tokens": 60}, "you requested 70 tokens"),
        (10, {"max_tokens": 5, "min_tokens": 6}, "min_tokens"),
        (10, {"max_tokens": 5, "n": 2}, "n=1"),
        (0, {"max_tokens": 5}, "empty"),
    ],
)
def test_refuses_what_the_engine_would_die_on(prompt_len, sampling, match):
    with pytest.raises(InvalidRequestError, match=match):
        admit(_request([1] * prompt_len, **sampling), max_model_len=64)


def test_admits_consistent_image_features():
    prompt = [1, PAD, PAD, 2, PAD, 3]
    admitted = admit(_request(prompt, [_feature(1, 2), _feature(4, 1)], max_tokens=4), max_model_len=64)
    assert admitted.prompt_token_ids == prompt


@pytest.mark.parametrize(
    ("prompt", "features", "match"),
    [
        ([1, PAD], [_feature(1, 2)], "out of bounds"),  # range runs past the end
        ([1, PAD, 5, 2], [_feature(1, 2)], "non-placeholder"),  # covers a non-placeholder token
        ([1, PAD, PAD, 2, PAD], [_feature(1, 2)], "outside the images' ranges"),  # a stray placeholder
        ([1, PAD, PAD, 2], [_feature(1, 2), _feature(1, 2)], "overlaps"),  # overlapping ranges
        ([1, PAD], [_feature(7, 1)], "out of bounds"),  # first range outside the prompt
        ([1, PAD, PAD], [_feature(1, 2, shape=(3, 4))], "bytes, expected"),  # tensor shape lies about its size
    ],
)
def test_refuses_inconsistent_image_features(prompt, features, match):
    with pytest.raises(InvalidRequestError, match=match) as caught:
        admit(_request(prompt, features, max_tokens=1), max_model_len=64)
    assert caught.value.param == "messages"
