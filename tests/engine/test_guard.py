"""The engine client's last check: nothing that would crash a vLLM engine gets through."""

from __future__ import annotations

import pytest

from mmserve.engine import InvalidRequestError, admit
from mmserve.wire import EngineCoreRequest, SamplingParams


def _request(prompt: list[int], **sampling) -> EngineCoreRequest:
    return EngineCoreRequest("r", prompt, None, SamplingParams(**sampling), None, 0.0, None, None, None)


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
