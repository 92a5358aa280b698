"""The last check before an ADD leaves for the engine.

vLLM's engine trusts its front-end: a prompt longer than the context, an inconsistent
multimodal placeholder or a duplicate request id kills the whole engine process (all of them
measured on vLLM 0.32). Every path to the engine goes through `admit`, so nothing reaches it
unchecked, whatever the caller validated before.
"""

from __future__ import annotations

import msgspec

from ..multimodal import PlaceholderMismatch, ProcessedImages, check_features, expand_image_placeholders
from ..wire import EngineCoreRequest
from .errors import EngineError


class PromptAccepted(msgspec.Struct, frozen=True):
    """First item of an image request's output stream: the prompt as sent to the engine
    (placeholders expanded), which the ingress needs for usage and detokenization."""

    prompt_token_ids: list[int]
    num_images: int = 0
    # Time the preprocessing tier spent on this request's images.
    preprocess_ms: float = 0.0


class InvalidRequestError(EngineError, ValueError):
    """The request would fail (or crash) the engine; the client gets a 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def admit(request: EngineCoreRequest, max_model_len: int, images: ProcessedImages | None = None) -> EngineCoreRequest:
    """Expand image placeholders, fill `max_tokens` if unset, and check everything vLLM would."""
    prompt = request.prompt_token_ids or []
    features = request.mm_features
    if images is not None:
        try:
            prompt, features = expand_image_placeholders(prompt, images)
        except PlaceholderMismatch as exc:
            raise InvalidRequestError(str(exc), "messages") from None
    elif features:
        try:
            check_features(prompt, features, _pad_of(features, prompt))
        except PlaceholderMismatch as exc:
            raise InvalidRequestError(str(exc), "messages") from None
    if not prompt:
        raise InvalidRequestError("the prompt is empty", "messages")
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{len(prompt)} input tokens, which leaves no room for any output tokens. Please reduce the length "
            "of the input prompt.",
            "messages",
        )
    sampling = request.sampling_params
    if sampling is None:
        raise InvalidRequestError("a generate request needs sampling parameters")
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt)
    elif len(prompt) + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            "max_tokens",
        )
    if max_tokens < 1 or sampling.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    if sampling.n != 1:
        raise InvalidRequestError("the engine takes n=1 requests; the front-end fans out n > 1")
    if max_tokens != sampling.max_tokens:
        sampling = msgspec.structs.replace(sampling, max_tokens=max_tokens)
    if prompt is request.prompt_token_ids and sampling is request.sampling_params:
        return request
    return msgspec.structs.replace(request, prompt_token_ids=prompt, mm_features=features, sampling_params=sampling)


def _pad_of(features, prompt: list[int]) -> int:
    first = features[0].mm_position
    if not 0 <= first.offset < len(prompt):
        raise PlaceholderMismatch("image placeholder range is out of bounds")
    return prompt[first.offset]
