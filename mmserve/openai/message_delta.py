"""vLLM 0.32's `DeltaMessage` as a parser-read stream sends it: a chunk's `delta`, encoded once.

vLLM sends it with `model_dump_json(exclude_unset=True)`: a field shows when a parser set it (to null
too), and `tool_calls` only when there are any. Here a field left `UNSET` is not shown, so the same
bytes come out (`tests/openai/test_reasoning_parsing.py`, `test_tool_call_parsing.py`).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from .tool_parsers import DeltaToolCall, ParsedDelta


class MessageDelta(msgspec.Struct):
    """`DeltaMessage` (its field order; never the role, which only the opening chunk carries)."""

    content: str | None | UnsetType = UNSET
    reasoning: str | None | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET

    @classmethod
    def of_content(cls, text: str) -> MessageDelta:
        return cls(content=text)

    @classmethod
    def of_tool_parser(cls, parsed: ParsedDelta) -> MessageDelta:
        """What a tool-call parser returned: its content always set, its calls when there are any."""
        return cls(content=parsed.content, tool_calls=parsed.tool_calls or UNSET)


__all__ = ["UNSET", "MessageDelta"]
