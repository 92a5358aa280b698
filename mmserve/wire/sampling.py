"""Sampling parameters as they travel inside an ADD request.

Mirrors `vllm.sampling_params.SamplingParams` and `StructuredOutputsParams` of vLLM 0.32.
Both are msgpack *maps* on the wire (not array-like), so field names are the contract and
the engine fills absent fields with its own defaults (`omit_defaults=True` keeps requests
small). The engine runs `SamplingParams.__post_init__` on decode, which re-validates ranges
and merges `stop_token_ids` into `_all_stop_token_ids`.

The underscore fields are not private on the wire: vLLM's front-end sets them after
reading the model's generation config, and the engine's scheduler relies on them
(`_eos_token_id` stops generation, `_all_stop_token_ids` gates `min_tokens`).
"""

from __future__ import annotations

import msgspec


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """Mirrors `vllm.sampling_params.StructuredOutputsParams` (a dataclass → msgpack map)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # Set by vLLM's front-end (`_validate_structured_outputs`); the engine builds its grammar
    # backend from the first request's `_backend` and fails requests without one.
    _backend: str | None = None
    _backend_was_auto: bool = False


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Mirrors `vllm.sampling_params.SamplingParams` (msgspec map, `omit_defaults=True`).

    Only the fields a gateway sets are listed; the engine defaults every other one.
    Defaults here must equal vLLM's so that omitting a field means the same thing.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # Stop strings are matched by the front-end (the engine never detokenizes); they are
    # still sent so the engine's own validation sees the same request vLLM's would.
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[int]] | None = None
    # Set from the tokenizer's EOS unless ignore_eos; the scheduler stops on it.
    _eos_token_id: int | None = None
    # EOS ids (tokenizer + generation_config) and stop_token_ids; used by min_tokens.
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)
