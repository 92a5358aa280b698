"""What every tool-call parser gives: the calls of a whole answer, or a stream's next delta.

Each struct names the vLLM 0.32 type it mirrors (`vllm.entrypoints.generate.base.protocol`).
A parser instance serves one choice of one request: streaming keeps state.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import msgspec


def make_tool_call_id() -> str:
    """vLLM's `make_tool_call_id()` (the "random" kind)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedToolCall:
    """vLLM's `ToolCall` of a whole answer."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCalls:
    """vLLM's `ExtractedToolCallInformation`."""

    tools_called: bool
    tool_calls: list[ParsedToolCall]
    content: str | None


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    """vLLM's `DeltaFunctionCall`, as its `model_dump(exclude_unset=True)` shows it: only what was set."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """vLLM's `DeltaToolCall` (exclude_unset: `id` and `type` only on a call's first delta)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


@dataclass
class ParsedDelta:
    """vLLM's `DeltaMessage` as a tool-call parser returns it: `content` always set (a chunk shows it,
    null when there is none), `tool_calls` shown only when there are any."""

    content: str | None
    tool_calls: list[DeltaToolCall]


class ToolCallParser:
    """vLLM's `ToolParser`: one choice's parser. `structural_tag_model` names the structural tag that
    makes the engine write this parser's format (`structural_tags.py`)."""

    structural_tag_model: str
    # Requests that may call tools keep special tokens in their text (vLLM's `adjust_request` sets
    # skip_special_tokens false): the call markers are special tokens in some tokenizers.
    keeps_special_tokens: bool = False

    def __init__(self) -> None:
        # vLLM's streaming state: per call, what was parsed and what was sent of its arguments.
        self.prev_tool_call_arr: list[dict] = []
        self.streamed_args_for_tool: list[str] = []

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """The calls of a whole answer (vLLM's `extract_tool_calls`)."""
        raise NotImplementedError

    def extract_tool_calls_streaming(self, current_text: str) -> ParsedDelta | None:
        """What is new in a stream whose text so far is `current_text` (vLLM's `extract_tool_calls_streaming`,
        which also takes the previous text and the deltas; the parsers here read the whole text)."""
        raise NotImplementedError

    def remaining_unstreamed_args(self) -> str:
        """vLLM's `get_remaining_unstreamed_args`: arguments of the last call parsed but not sent."""
        if not self.prev_tool_call_arr:
            return ""
        index = len(self.prev_tool_call_arr) - 1
        args = self.prev_tool_call_arr[index].get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        actual = self.streamed_args_for_tool[index] if index < len(self.streamed_args_for_tool) else ""
        return expected[len(actual):] if expected.startswith(actual) else ""

