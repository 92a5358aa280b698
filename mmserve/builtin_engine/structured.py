"""Structured outputs in the built-in engine: its answers follow the request's grammar.

A vLLM engine compiles a request's `structured_outputs` with xgrammar and, at each step, masks its
logits to the tokens the grammar allows. The built-in engine has no logits: at each step it takes the
token its answer would have had if the grammar allows it, else the allowed token it prefers: the text the
grammar forces, then, while the answer is shorter than its natural length, its own words; past it, what
closes the answer (a quote, a bracket, the end). So a constrained answer reads like the engine's
ordinary ones where the grammar leaves room, and ends within the constraint. It compiles with the
xgrammar the gateway checks specs with (its native part: `mmserve/xgrammar_native.py`), as vLLM's
xgrammar backend does (`backend_xgrammar.py`): JSON schemas in strict mode, JSON objects, regexes, EBNF
and Lark grammars (choices arrive as EBNF), structural tags.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..xgrammar_native import is_lark, xgrammar_module

# xgrammar's `VocabType.BYTE_LEVEL`: the tokenizer's vocabulary in GPT-2's byte-to-unicode form.
_BYTE_LEVEL = 2
# Characters that close what the grammar opened, most preferred first, once the answer is long enough.
_CLOSERS = ('"', "}", "]", ")")
# How many of its own next tokens the engine tries before it takes any allowed one.
_OWN_TOKENS_TRIED = 8


class StructuredVocab:
    """The model's vocabulary as xgrammar sees it, and each token's text."""

    def __init__(self, tokens: list[str], texts: list[str], vocab_size: int, stop_ids: list[int]) -> None:
        self.texts = texts
        self.vocab_size = vocab_size
        core = xgrammar_module("base")._core
        self._compiler = core.GrammarCompiler(core.TokenizerInfo(tokens, _BYTE_LEVEL, vocab_size, stop_ids, False), 1, True, -1)

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> StructuredVocab:
        """From a `tokenizers.Tokenizer` (byte-level BPE, as the built-in model's)."""
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        tokens = [""] * max(vocab_size, max(vocab.values()) + 1)
        for token, token_id in vocab.items():
            tokens[token_id] = token
        texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(len(tokens))]
        return cls(tokens, texts, vocab_size, stop_ids)

    def compile(self, params: dict[str, Any]) -> Any:
        """The compiled grammar of a request's `structured_outputs` (vLLM's field names)."""
        compiler = self._compiler
        any_whitespace = not params.get("disable_any_whitespace", False)
        separators = (",", ":") if not any_whitespace else None
        if params.get("json") is not None:
            schema = params["json"]
            return compiler.compile_json_schema(schema if isinstance(schema, str) else json.dumps(schema), any_whitespace, None, separators, True, None, False)
        if params.get("json_object"):
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace, None, separators, True, None, False)
        if params.get("regex") is not None:
            return compiler.compile_regex(params["regex"])
        if (grammar := params.get("grammar")) is not None:  # (choices too: the front end sends them as EBNF)
            return compiler.compile_lark(grammar, [], []) if is_lark(grammar) else compiler.compile_grammar_from_strings(grammar, "root")
        if params.get("structural_tag") is not None:
            return compiler.compile_structural_tag(params["structural_tag"])
        raise ValueError(f"no constraint in structured_outputs: {sorted(params)}")


class GrammarFollower:
    """One request's tokens, each chosen among those its grammar allows (see the module's doc)."""

    def __init__(self, vocab: StructuredVocab, compiled: Any, eos: int | None, stop_ids: frozenset[int]) -> None:
        self._vocab = vocab
        self._eos = eos
        self._stop_ids = stop_ids
        self._matcher = xgrammar_module("base")._core.GrammarMatcher(compiled, None, False, -1, None)
        self._bitmask = np.zeros((1, (vocab.vocab_size + 31) // 32), dtype=np.int32)

    def next_token(self, own: Iterator[int], long_enough: bool) -> int:
        """The next token: `own` is the engine's answer as it would be unconstrained."""
        allowed = self._allowed()
        token = self._choose(allowed, own, long_enough)
        if allowed:
            self._matcher.accept_token(token, False)
        return token

    def _allowed(self) -> set[int]:
        if self._matcher.is_terminated():
            return set()
        self._matcher.fill_next_token_bitmask(self._bitmask, 0, False)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self._vocab.vocab_size]
        return set(np.flatnonzero(bits).tolist())

    def _choose(self, allowed: set[int], own: Iterator[int], long_enough: bool) -> int:
        texts = self._vocab.texts
        if not allowed or allowed <= self._stop_ids - {self._eos}:
            # The answer is complete; with `ignore_eos` it goes on with the end of text, as vLLM's would.
            return self._eos if self._eos is not None else min(self._stop_ids)
        ends = self._eos is not None and self._eos in allowed
        if ends and (long_enough or allowed == {self._eos}):
            return self._eos  # type: ignore[return-value]
        forced = self._matcher.find_jump_forward_string()
        if forced:
            prefixes = [t for t in allowed if texts[t] and forced.startswith(texts[t])]
            if prefixes:
                return max(prefixes, key=lambda t: (len(texts[t]), -t))
        if not long_enough:
            for _ in range(_OWN_TOKENS_TRIED):
                if (token := next(own)) in allowed:
                    return token
        candidates = sorted(t for t in allowed if t != self._eos)
        if long_enough:
            for closer in _CLOSERS:
                if closing := [t for t in candidates if texts[t].strip() == closer]:
                    return closing[0]
            if ends:
                return self._eos  # type: ignore[return-value]
            if punctuation := [t for t in candidates if len(texts[t].strip()) == 1 and not texts[t].strip().isalnum()]:
                return punctuation[0]
        return min(candidates or [self._eos], key=lambda t: (len(texts[t]) == 0, _letters_first(texts[t]), len(texts[t]), t))  # type: ignore[list-item]


def _letters_first(text: str) -> int:
    """Words before digits before anything else, for text the grammar leaves open."""
    return 0 if text.strip().isalpha() else 1 if text.strip().isdigit() else 2


@functools.lru_cache(maxsize=8)
def vocab_of(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> StructuredVocab:
    return StructuredVocab.of_tokenizer(tokenizer, vocab_size, list(stop_ids))
