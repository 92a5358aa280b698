"""Reasoning parsers: the model's text → reasoning and content, as vLLM 0.32's parsers of the same name
split it (`--reasoning-parser NAME`), for the answer's `reasoning` field.

One module per family of parsers: `think_tags.py` (`deepseek_r1`: vLLM's `<think>` tag parsers) and
`qwen3.py` (vLLM's `qwen3`, a grammar run by its parser engine: `grammar.py`, `parser_engine.py`, `lexer.py`
and `token_id_scanner.py`). `REASONING_PARSERS` is the registry a model's config names one from: each
entry binds its parser to a model's tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable

from mmserve.text import Tokenizer

from .base import ReasoningParser, ReasoningSetup
from .qwen3 import Qwen3ReasoningSetup
from .think_tags import DeepSeekR1ReasoningParser, ThinkTagReasoningParser, ThinkTagReasoningSetup

REASONING_PARSERS: dict[str, Callable[[Tokenizer], ReasoningSetup]] = {
    "deepseek_r1": lambda tokenizer: ThinkTagReasoningSetup(DeepSeekR1ReasoningParser, "deepseek_r1", tokenizer),
    "qwen3": Qwen3ReasoningSetup,
}

__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "ReasoningParser",
    "ReasoningSetup",
    "ThinkTagReasoningParser",
]
