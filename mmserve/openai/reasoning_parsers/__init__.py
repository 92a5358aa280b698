"""Reasoning parsers: the model's text → reasoning and content, as vLLM 0.32's parsers of the same name
split it (`--reasoning-parser NAME`), for the answer's `reasoning` field.

One module per family of parsers; `REASONING_PARSERS` is the registry a model's config names one from.
Partial: only the think-tag parser `deepseek_r1` (vLLM's `qwen3` runs on its parser engine and is not
served here).
"""

from __future__ import annotations

from .base import ReasoningParser
from .think_tags import DeepSeekR1ReasoningParser, ThinkTagReasoningParser

REASONING_PARSERS: dict[str, type[ThinkTagReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
}

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "ReasoningParser", "ThinkTagReasoningParser"]
