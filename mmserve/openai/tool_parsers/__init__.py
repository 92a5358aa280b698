"""Tool-call parsers: the model's text → tool calls, as vLLM 0.32's parsers of the same name read it, and
the structural tag that constrains the engine to their format (`--tool-call-parser NAME`).

One module per parser; `TOOL_CALL_PARSERS` is the registry a model's config names one from.
"""

from __future__ import annotations

from .base import DeltaToolCall, ParsedDelta, ParsedToolCall, ToolCallParser
from .hermes import HermesToolParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
}

__all__ = ["TOOL_CALL_PARSERS", "DeltaToolCall", "HermesToolParser", "ParsedDelta", "ParsedToolCall", "ToolCallParser"]
