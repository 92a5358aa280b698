"""The last check before an ADD leaves for the engine: `admit` and `InvalidRequestError`.

vLLM's engine trusts its front-end: a prompt longer than the context, an inconsistent
multimodal placeholder or a duplicate request id kills the whole engine process (vLLM 0.32's
engine core). Every path to the engine goes through `admit`, so nothing reaches it
unchecked, whatever the caller validated before. It reads only wire structs: image
placeholders are expanded before this, with the images (`mmserve.multimodal.features`).
"""

from __future__ import annotations

import msgspec

from ..wire import EngineCoreRequest, MultiModalFeatureSpec
from .errors import EngineError


class InvalidRequestError(EngineError, ValueError):
    """The request would fail (or crash) the engine: the client's mistake (`param` names the field)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        # OpenAI's machine-readable error code, e.g. "context_length_exceeded".
        self.code = code


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def context_exceeded(max_model_len: int, prompt_len: int, param: str = "messages") -> InvalidRequestError:
    """A prompt that leaves no room for output (the context rule's first half, worded as vLLM does)."""
    return InvalidRequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{prompt_len} input tokens, which leaves no room for any output tokens. Please reduce the length "
        "of the input prompt.",
        param,
        CONTEXT_LENGTH_EXCEEDED,
    )


def fit_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, prompt_param: str = "messages") -> int:
    """The context rule, its one home: the prompt must leave room for output, and prompt plus
    `max_tokens` must fit the context. Returns `max_tokens`, or (unset) what is left of the context."""
    if prompt_len >= max_model_len:
        raise context_exceeded(max_model_len, prompt_len, prompt_param)
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            "max_tokens",
            CONTEXT_LENGTH_EXCEEDED,
        )
    return max_tokens


def admit(request: EngineCoreRequest, max_model_len: int) -> EngineCoreRequest:
    """Fill `max_tokens` if unset, and check everything vLLM would die on."""
    prompt = request.prompt_token_ids or []
    if request.mm_features:
        check_features(prompt, request.mm_features)
    if not prompt:
        raise InvalidRequestError("the prompt is empty", "messages")
    sampling = request.sampling_params
    max_tokens = fit_max_tokens(len(prompt), sampling.max_tokens if sampling is not None else None, max_model_len)
    if sampling is None:
        raise InvalidRequestError("a generate request needs sampling parameters")
    if max_tokens < 1 or sampling.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    if sampling.n != 1:
        raise InvalidRequestError("the engine takes n=1 requests; the front-end fans out n > 1")
    if max_tokens == sampling.max_tokens:
        return request
    return msgspec.structs.replace(request, sampling_params=msgspec.structs.replace(sampling, max_tokens=max_tokens))


def check_features(prompt_token_ids: list[int], features: list[MultiModalFeatureSpec]) -> None:
    """Placeholder ranges in bounds, ordered, non-overlapping, covering only the placeholder token
    (the one the first range starts on), none outside them, and every tensor's byte size equal
    to shape × itemsize."""
    first = features[0].mm_position
    if not 0 <= first.offset < len(prompt_token_ids):
        raise InvalidRequestError("image placeholder range is out of bounds", "messages")
    pad = prompt_token_ids[first.offset]
    end_of_previous = 0
    for feature in features:
        rng = feature.mm_position
        if rng.offset < end_of_previous or rng.length < 1 or rng.offset + rng.length > len(prompt_token_ids):
            raise InvalidRequestError(f"image placeholder range {rng.offset}+{rng.length} is out of bounds or overlaps", "messages")
        if any(t != pad for t in prompt_token_ids[rng.offset : rng.offset + rng.length]):
            raise InvalidRequestError("an image placeholder range covers non-placeholder tokens", "messages")
        end_of_previous = rng.offset + rng.length
        for name, elem in (feature.data or {}).items():
            tensor = elem.data
            if tensor is None:
                continue
            expected = tensor.array.itemsize
            for dim in tensor.shape:
                expected *= dim
            if tensor.array.nbytes != expected:
                raise InvalidRequestError(f"tensor {name} has {tensor.array.nbytes} bytes, expected {expected}", "messages")
    if sum(t == pad for t in prompt_token_ids) != sum(f.mm_position.length for f in features):
        raise InvalidRequestError("the prompt has image placeholder tokens outside the images' ranges", "messages")
