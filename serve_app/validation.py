"""Request checks that vLLM's front-end would make, made here before anything reaches an engine.

Going direct to EngineCore skips vLLM's own API-server validation, and the engine treats
some bad values as fatal. Each check names the offending field in the 400 it raises.
Ranges follow `vllm.sampling_params.SamplingParams._verify_args` (vLLM 0.32).
"""

from __future__ import annotations

import math

from .config import LimitsConfig
from .errors import bad_request
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingRequestFields

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


def check_chat_request(request: ChatCompletionRequest) -> None:
    if request.logprobs or request.top_logprobs:
        raise bad_request("logprobs are not supported by this server yet", "logprobs")
    if request.tools:
        raise bad_request("tool calling is not supported by this server yet", "tools")
    if request.add_generation_prompt and request.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true", "continue_final_message")
    if request.max_completion_tokens is not None and request.max_tokens is not None and request.max_completion_tokens != request.max_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one of them", "max_completion_tokens")


def check_completion_request(request: CompletionRequest) -> None:
    if request.echo:
        raise bad_request("echo is not supported by this server yet", "echo")
    if request.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if request.logprobs is not None:
        raise bad_request("logprobs are not supported by this server yet", "logprobs")


def check_token_ids(token_ids: list[int], max_token_id: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id <= max_token_id:
            raise bad_request(f"token id {token_id} is out of vocabulary (0..{max_token_id})", param)


def _finite(value: float | None, param: str) -> None:
    if value is not None and not math.isfinite(value):
        raise bad_request(f"{param} must be a finite number, got {value}", param)


def check_sampling(request: SamplingRequestFields, max_tokens: int, limits: LimitsConfig, max_token_id: int) -> None:
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        _finite(getattr(request, name), name)
    if not 1 <= request.n <= limits.max_n:
        raise bad_request(f"n must be between 1 and {limits.max_n}, got {request.n}", "n")
    if request.temperature is not None and not 0.0 <= request.temperature <= 2.0:
        raise bad_request(f"temperature must be in [0, 2], got {request.temperature}", "temperature")
    if request.top_p is not None and not 0.0 < request.top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {request.top_p}", "top_p")
    if request.top_k is not None and request.top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (disabled), or at least 1, got {request.top_k}", "top_k")
    if request.min_p is not None and not 0.0 <= request.min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {request.min_p}", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise bad_request(f"{name} must be in [-2, 2], got {value}", name)
    if request.repetition_penalty is not None and request.repetition_penalty <= 0.0:
        raise bad_request(f"repetition_penalty must be greater than zero, got {request.repetition_penalty}", "repetition_penalty")
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if request.min_tokens < 0:
        raise bad_request(f"min_tokens must be at least 0, got {request.min_tokens}", "min_tokens")
    if request.min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be at most max_tokens={max_tokens}, got {request.min_tokens}", "min_tokens")
    if request.seed is not None and not _INT64_MIN <= request.seed <= _UINT64_MAX:
        raise bad_request("seed must fit in 64 bits", "seed")
    stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    if len(stop) > limits.max_stop_strings:
        raise bad_request(f"at most {limits.max_stop_strings} stop strings are allowed", "stop")
    for s in stop:
        if not s:
            raise bad_request("stop cannot contain an empty string", "stop")
        if len(s) > limits.max_stop_string_chars:
            raise bad_request(f"stop strings are limited to {limits.max_stop_string_chars} characters", "stop")
    check_token_ids(request.stop_token_ids or [], max_token_id, "stop_token_ids")
    for key, bias in (request.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        check_token_ids([token_id], max_token_id, "logit_bias")
        if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")
