"""`hermes`: calls written as `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Hermes 2 Pro, Qwen2.5
and later): vLLM 0.32's `Hermes2ProToolParser`, read for read.

A whole answer: every `<tool_call>` region's JSON, or (a truncated answer) the last region's JSON up to the
end; any region that is not JSON with a `name` and `arguments` makes the answer plain content, as in vLLM.
A stream: each delta re-reads the whole text so far and sends what is new: content up to the first
`<tool_call>` (holding back a suffix that may be the start of one), a call's name once complete, then
its arguments as they grow.
"""

from __future__ import annotations

import json
import logging
import re

from .base import DeltaFunctionCall, DeltaToolCall, ExtractedToolCalls, ParsedDelta, ParsedToolCall, ToolCallParser, make_tool_call_id

logger = logging.getLogger(__name__)

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def partial_tag_overlap(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that ends `text` (vLLM's helper)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _name(call: dict) -> str:
    name = call["name"]
    if not isinstance(name, str):  # vLLM's FunctionCall model refuses it
        raise TypeError(f"the function name is {type(name).__name__}, not a string")
    return name


class HermesToolParser(ToolCallParser):
    structural_tag_model = "hermes"
    keeps_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._sent_content_idx = 0

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        if START not in model_output:
            return ExtractedToolCalls(False, [], model_output)
        try:
            calls = [json.loads(whole or open_ended) for whole, open_ended in _CALLS.findall(model_output)]
            tool_calls = [ParsedToolCall(_name(call), json.dumps(call["arguments"], ensure_ascii=False)) for call in calls]
        except (ValueError, KeyError, TypeError) as exc:
            # The model's text, not the client's request: kept as content, as vLLM keeps it.
            logger.info("tool call not parsed, answered as content: %s: %s", type(exc).__name__, exc)
            return ExtractedToolCalls(False, [], model_output)
        content = model_output[: model_output.find(START)]
        return ExtractedToolCalls(True, tool_calls, content or None)

    # ------------------------------------------------------------------ streaming

    def _content(self, current_text: str) -> str | None:
        """Content not yet sent, up to the first `<tool_call>` or a suffix that may start one."""
        if START not in current_text:
            sendable = len(current_text) - partial_tag_overlap(current_text, START)
        else:
            sendable = current_text.index(START)
        if sendable > self._sent_content_idx:
            content = current_text[self._sent_content_idx : sendable]
            self._sent_content_idx = sendable
            return content
        return None

    @staticmethod
    def _call_jsons(text: str) -> list[tuple[str, bool]]:
        """(JSON text, complete?) of each `<tool_call>` region so far."""
        results: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            json_start = start + len(START)
            json_end = text.find(END, json_start)
            if json_end != -1:
                results.append((text[json_start:json_end].strip(), True))
                pos = json_end + len(END)
                continue
            raw = text[json_start:]
            if overlap := partial_tag_overlap(raw, END):
                raw = raw[:-overlap]
            call_json = raw.strip()
            # Whole JSON without its closing tag: the body is complete, the tag tokens still to come.
            results.append((call_json, _is_complete_json(call_json) if call_json else False))
            break
        return results

    @staticmethod
    def _arguments(call_json: str, complete: bool) -> str | None:
        """The arguments' text so far; of a complete call, without the brace closing the call."""
        match = _ARGUMENTS.search(call_json)
        if not match:
            return None
        raw = call_json[match.end() :]
        if complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw

    def extract_tool_calls_streaming(self, current_text: str) -> ParsedDelta | None:
        content = self._content(current_text)
        deltas: list[DeltaToolCall] = []
        for i, (call_json, complete) in enumerate(self._call_jsons(current_text)):
            if i >= len(self.prev_tool_call_arr):
                self.prev_tool_call_arr.append({})
                self.streamed_args_for_tool.append("")
            if "name" not in self.prev_tool_call_arr[i]:
                match = _NAME.search(call_json)
                if not match:
                    break  # call i+1 waits for call i's name
                self.prev_tool_call_arr[i]["name"] = match.group(1)
                deltas.append(DeltaToolCall(i, make_tool_call_id(), "function", DeltaFunctionCall(name=match.group(1))))
            args = self._arguments(call_json, complete)
            if args is not None and len(args) > len(self.streamed_args_for_tool[i]):
                diff = args[len(self.streamed_args_for_tool[i]) :]
                self.streamed_args_for_tool[i] = self.prev_tool_call_arr[i]["arguments"] = args
                deltas.append(DeltaToolCall(i, function=DeltaFunctionCall(arguments=diff)))
        if content or deltas:
            return ParsedDelta(content, deltas)
        return None
