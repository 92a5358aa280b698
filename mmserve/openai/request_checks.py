"""Request checks vLLM's front-end makes (ranges, unsupported fields, token ids, bad words), made before any engine sees a request.

Going direct to EngineCore skips vLLM's own API-server validation, and the engine treats
some bad values as fatal. Each check names the offending field in the 400 it raises.
Ranges follow `vllm.sampling_params.SamplingParams._verify_args` (vLLM 0.32).
"""

from __future__ import annotations

import json
import math

from .errors import bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingRequestFields
from .settings import ServingLimits
from .settings import ToolCallSettings
from .tool_calls import ToolChoiceMode, check_tools

_INT64_MIN, _INT64_MAX, _UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1

# Caps on request-sized inputs (vLLM's are in brackets where it has one).
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOKEN_ID_LIST = 4096  # stop_token_ids, allowed_token_ids
MAX_BAD_WORDS_TOKEN_SEQUENCES = 128  # [VLLM_MAX_NUM_BAD_WORDS]
MAX_BAD_WORD_CHARS = 512


# vLLM 0.32 request fields mmserve does not implement, each with vLLM's default. Set to anything else, a
# field is refused with a 400 naming it: `vllm serve` would answer such a request differently, and a 200
# that silently ignored it would not say so. vLLM fields absent from both the models and these tables
# change no answer here and are accepted whatever their value (NEUTRAL_VLLM_FIELDS).
# tests/openai/test_vllm_request_fields.py checks these against vLLM's own request models.
NOT_IMPLEMENTED_VLLM_FIELDS: dict[str, object] = {
    "use_beam_search": False,
    "watermarking": None,
    "logprob_token_ids": None,
    "priority": 0,
    "return_tokens_as_token_ids": None,
    "routed_experts_prompt_start": 0,
    "return_token_offsets": False,
    "mm_payload": "tensors",
    "return_mm_kwargs": None,
    "cache_salt": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "vllm_xargs": None,
    "repetition_detection": None,
    "thinking_token_budget": None,
}
NOT_IMPLEMENTED_CHAT_FIELDS: dict[str, object] = {
    **NOT_IMPLEMENTED_VLLM_FIELDS,
    "echo": False,
    "add_special_tokens": False,
    "documents": None,
    "chat_template": None,
    "media_io_kwargs": None,
    "mm_processor_kwargs": None,
    "return_prompt_text": None,
}
NOT_IMPLEMENTED_COMPLETION_FIELDS: dict[str, object] = {
    **NOT_IMPLEMENTED_VLLM_FIELDS,
    "add_special_tokens": True,
    "prompt_embeds": None,
}
# Answer-neutral here: ids and chunking (`request_id`, `session_id`, `stream_interval`), or meaningful only
# with a feature refused on its own (`length_penalty` with beam search, `truncation_side` with
# `truncate_prompt_tokens`).
NEUTRAL_VLLM_FIELDS = frozenset({"request_id", "session_id", "stream_interval", "length_penalty", "truncation_side"})


def _check_not_implemented(request: SamplingRequestFields, fields: dict[str, object]) -> None:
    extra = request.model_extra or {}
    for name, default in fields.items():
        value = extra.get(name, default)
        if value != default and not (default is None and value in ({}, [])):
            raise bad_request(f"{name} is not supported by this server (only its default, {json.dumps(default)})", name)


def _check_unsupported(request: SamplingRequestFields, not_implemented: dict[str, object]) -> None:
    if request.truncate_prompt_tokens is not None:
        raise bad_request("truncate_prompt_tokens is not supported by this server", "truncate_prompt_tokens")
    _check_not_implemented(request, not_implemented)


def check_chat_request(request: ChatCompletionRequest, tool_calls: ToolCallSettings) -> ToolChoiceMode:
    """Checks of a chat request's own fields; returns its tool choice, as its answer reads it."""
    _check_unsupported(request, NOT_IMPLEMENTED_CHAT_FIELDS)
    top_logprobs = request.top_logprobs
    if top_logprobs is not None:
        # vLLM's ChatCompletionRequest.check_logprobs, word for word.
        if top_logprobs < 0 and top_logprobs != -1:
            raise bad_request("`top_logprobs` must be a positive value or -1.", "top_logprobs")
        if (top_logprobs == -1 or top_logprobs > 0) and not request.logprobs:
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    tool_choice = check_tools(request, tool_calls)
    if request.add_generation_prompt and request.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true", "continue_final_message")
    if request.max_completion_tokens is not None and request.max_tokens is not None and request.max_completion_tokens != request.max_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one of them", "max_completion_tokens")
    _check_chat_template_kwargs(request.chat_template_kwargs)
    return tool_choice


# In `chat_template_kwargs`: what vLLM refuses, in its words, and what it would hand to the template
# renderer beside the request's own (documents, tools), which this server does not.
_TEMPLATE_KWARGS_VLLM_REFUSES = ("chat_template", "tokenize")
_TEMPLATE_KWARGS_NOT_SUPPORTED = ("documents", "tools", "messages", "conversation")


def _check_chat_template_kwargs(kwargs: dict | None) -> None:
    if not kwargs:
        return
    if unexpected := {name for name in _TEMPLATE_KWARGS_VLLM_REFUSES if name in kwargs}:
        raise bad_request(f"Found unexpected chat template kwargs from request: {unexpected}", "chat_template_kwargs")
    if given := [name for name in _TEMPLATE_KWARGS_NOT_SUPPORTED if name in kwargs]:
        raise bad_request(
            f"chat_template_kwargs {given} are not supported by this server (tools go in the request's `tools`)",
            "chat_template_kwargs",
        )


def chat_logprobs(request: ChatCompletionRequest, max_logprobs: int, vocab_size: int, engine_kind: str) -> int | None:
    """The engine's `SamplingParams.logprobs` for a chat request (None: not asked for), as vLLM sets
    it (`top_logprobs` when `logprobs`), checked against the engines' `--max-logprobs` as vLLM does."""
    if not request.logprobs:
        return None
    return _checked_logprobs(request.top_logprobs or 0, max_logprobs, vocab_size, engine_kind)


def completion_logprobs(request: CompletionRequest, max_logprobs: int, vocab_size: int, engine_kind: str) -> int | None:
    """The engine's `SamplingParams.logprobs` for a completion request (None: not asked for),
    checked as vLLM checks it."""
    requested = request.logprobs
    if requested is None:
        return None
    if requested < 0 and requested != -1:
        raise bad_request("`logprobs` must be a positive value or -1.", "logprobs")
    return _checked_logprobs(requested, max_logprobs, vocab_size, engine_kind)


def prompt_logprobs(request: SamplingRequestFields, max_logprobs: int, vocab_size: int, engine_kind: str) -> int | None:
    """The engine's `SamplingParams.prompt_logprobs` (None: not asked for), checked word for word as
    vLLM's request models (`check_logprobs`) and `SamplingParams._validate_logprobs` check it."""
    requested = request.prompt_logprobs
    if requested is None:
        return None
    if request.stream and (requested > 0 or requested == -1):
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if requested < 0 and requested != -1:
        raise bad_request("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
    return _checked_logprobs(requested, max_logprobs, vocab_size, engine_kind, "prompt")


# Fields that shape a real model's token distribution, which mmserve's built-in engine does not have.
BUILTIN_ENGINE_CANNOT_HONOUR = ("logit_bias", "allowed_token_ids", "bad_words")


def check_engine_can_honour(request: SamplingRequestFields, engine_kind: str) -> None:
    """A 400 for what the engine would silently ignore: the built-in engine has no token distribution
    to bias (as it computes no logprobs); its structured outputs it follows."""
    if engine_kind != "mmserve-builtin":
        return
    for name in BUILTIN_ENGINE_CANNOT_HONOUR:
        if getattr(request, name, None):
            raise bad_request(f"{name} is not honoured by mmserve's built-in engine (serve a vLLM engine for it)", name)


def _checked_logprobs(requested: int, max_logprobs: int, vocab_size: int, engine_kind: str, kind: str = "sample") -> int:
    param = "logprobs" if kind == "sample" else "prompt_logprobs"
    if engine_kind == "mmserve-builtin":
        raise bad_request(f"{param} are not computed by mmserve's built-in engine (serve a vLLM engine for them)", param)
    allowed = vocab_size if max_logprobs == -1 else max_logprobs
    if (vocab_size if requested == -1 else requested) > allowed:
        raise bad_request(
            f"Requested {kind} logprobs of {vocab_size if requested == -1 else requested}, "
            f"which is greater than max allowed: {allowed}", param,
        )
    return requested


def check_completion_request(request: CompletionRequest) -> None:
    _check_unsupported(request, NOT_IMPLEMENTED_COMPLETION_FIELDS)
    if request.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")


def check_token_ids(token_ids: list[int], max_token_id: int, param: str) -> None:
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise bad_request(f"token ids must be integers, got {token_id!r}", param)
        if not 0 <= token_id <= max_token_id:
            raise bad_request(f"token id {token_id} is out of vocabulary (0..{max_token_id})", param)


def _finite(value: float | None, param: str) -> None:
    if value is not None and not math.isfinite(value):
        raise bad_request(f"{param} must be a finite number, got {value}", param)


def check_sampling(request: SamplingRequestFields, max_tokens: int, limits: ServingLimits, max_token_id: int) -> None:
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        _finite(getattr(request, name), name)
    if not 1 <= request.n <= limits.max_n:
        raise bad_request(f"n must be between 1 and {limits.max_n}, got {request.n}", "n")
    if request.temperature is not None and not 0.0 <= request.temperature <= 2.0:
        raise bad_request(f"temperature must be in [0, 2], got {request.temperature}", "temperature")
    if request.top_p is not None and not 0.0 < request.top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {request.top_p}", "top_p")
    if request.top_k is not None and not -1 <= request.top_k <= _INT64_MAX:
        raise bad_request(f"top_k must be -1 or 0 (disabled), or at least 1, got {request.top_k}", "top_k")
    if request.n > 1 and request.temperature is not None and request.temperature < 1e-5:
        # vLLM's SamplingParams._verify_greedy_sampling.
        raise bad_request(f"n must be 1 when using greedy sampling (temperature=0), got {request.n}", "n")
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
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = getattr(request, name)
        if ids is not None and len(ids) > MAX_TOKEN_ID_LIST:
            raise bad_request(f"{name} is limited to {MAX_TOKEN_ID_LIST} token ids", name)
        check_token_ids(ids or [], max_token_id, name)
    if request.allowed_token_ids is not None and not request.allowed_token_ids:
        raise bad_request("allowed_token_ids cannot be an empty list", "allowed_token_ids")
    for word in request.bad_words or []:
        if not word or not word.strip():
            raise bad_request("bad_words cannot contain an empty or blank string", "bad_words")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise bad_request(f"bad_words entries are limited to {MAX_BAD_WORD_CHARS} characters", "bad_words")
    if request.bad_words and len(request.bad_words) > MAX_BAD_WORDS_TOKEN_SEQUENCES:
        raise bad_request(f"at most {MAX_BAD_WORDS_TOKEN_SEQUENCES} bad_words are allowed", "bad_words")
    if request.logit_bias and len(request.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"logit_bias is limited to {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias")
    for key, bias in (request.logit_bias or {}).items():
        try:
            if not key.strip().lstrip("+-").isdigit():
                raise ValueError(key)
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        check_token_ids([token_id], max_token_id, "logit_bias")
        if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")


def bad_words_token_ids(bad_words: list[str], encode, max_token_id: int) -> list[list[int]] | None:
    """`SamplingParams.update_from_tokenizer` of vLLM 0.32: each bad word as token ids, with
    and without a leading space. The engine reads only these ids, never `bad_words`."""
    if not bad_words:
        return None
    sequences: list[list[int]] = []
    for word in dict.fromkeys(bad_words):
        for add_prefix_space in (False, True):
            ids = encode((" " if add_prefix_space else "") + word.lstrip())
            if not ids:
                if not add_prefix_space:
                    raise bad_request(f"bad_words entry {word[:40]!r} does not tokenize to any token", "bad_words")
                continue
            if not add_prefix_space or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                sequences.append(ids)
                if len(sequences) > MAX_BAD_WORDS_TOKEN_SEQUENCES:
                    raise bad_request(
                        f"too many bad words after tokenization: at most {MAX_BAD_WORDS_TOKEN_SEQUENCES}", "bad_words"
                    )
    for ids in sequences:
        check_token_ids(ids, max_token_id, "bad_words")
    return sequences
