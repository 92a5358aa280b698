"""One choice's answer read for tool calls, whole or streamed: vLLM 0.32's `DelegatingParser` (no
reasoning parser) and the tool-call branches of its chat serving, for a server with a tool-call parser.

Whole: the parser reads the answer when `tool_choice` may call tools and auto tool choice is enabled
(vLLM's Hermes-style parsers, constrained by structural tags, read `required` and named answers as
`auto` ones); the message gets the calls, and `finish_reason` "tool_calls" for `auto` calls and for
`required` answers that stopped. Streamed: every delta goes through the parser, which sends nothing
until it has something (a delta with no text is not sent, unless it finishes the choice or carries
logprobs or token ids), and `finish_reason` is "tool_calls" when calls were streamed and the function
was not named. `parallel_tool_calls: false` keeps the first call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_calls import ToolCallPlan
from .tool_parsers import ParsedDelta, ParsedToolCall


@dataclass
class WholeAnswer:
    """What a choice's message and finish reason become."""

    content: str | None
    # None: the message has no `tool_calls`; a list (maybe empty) for `required` and named choices.
    tool_calls: list[ParsedToolCall] | None
    finish_reason: str | None


class ChoiceToolCalls:
    """One choice's tool-call reading (a parser keeps state while streaming)."""

    def __init__(self, plan: ToolCallPlan) -> None:
        self.plan = plan
        self.parser = plan.parser()
        self._text = ""  # the stream's text so far (the parser re-reads it whole, as vLLM's does)
        self.tools_streamed = False

    @property
    def shows_metadata(self) -> bool:
        """vLLM hides logprobs and token ids when `include_reasoning` is false and a parser is on."""
        return self.plan.include_reasoning

    # ------------------------------------------------------------------ whole answers

    def _parsed(self, text: str) -> tuple[list[ParsedToolCall] | None, str | None]:
        """vLLM's `DelegatingParser._extract_tool_calls` for a parser without required/named support."""
        plan = self.plan
        if plan.mode == "none" or not plan.enable_auto_tool_choice:
            return [], text
        info = self.parser.extract_tool_calls(text)
        if info.tools_called:
            content = info.content
            return info.tool_calls, None if content is not None and not content.strip() else content
        if plan.mode in ("required", "named") and not text.strip():
            return [], None
        return None, text

    def whole(self, text: str, finish_reason: str | None) -> WholeAnswer:
        calls, content = self._parsed(text)
        mode = self.plan.mode
        if mode in ("required", "named"):
            answer = WholeAnswer(content or "", list(calls or []), finish_reason)
            if mode == "required" and finish_reason == "stop":
                answer.finish_reason = "tool_calls"
        elif mode == "auto" and self.plan.enable_auto_tool_choice and calls:
            answer = WholeAnswer(content, calls, "tool_calls")
        else:  # none, null, or auto without calls
            answer = WholeAnswer(content, None, finish_reason)
        if answer.tool_calls and self.plan.parallel_tool_calls is False:
            answer.tool_calls = answer.tool_calls[:1]
        return answer

    # ------------------------------------------------------------------ streams

    def delta(self, delta_text: str, finished: bool) -> ParsedDelta | str | None:
        """vLLM's `parse_delta`: plain content (a str), content and tool-call deltas, or None."""
        if self.plan.mode == "none":
            return delta_text or None  # no calls to read: nothing kept per token
        self._text += delta_text
        message = self.parser.extract_tool_calls_streaming(self._text)
        if message is not None and message.tool_calls:
            self.tools_streamed = True
            if finished and (last := message.tool_calls[-1]).function is not None:
                last.function.arguments = (last.function.arguments or "") + self.parser.remaining_unstreamed_args()
            if self.plan.parallel_tool_calls is False:
                message.tool_calls = [call for call in message.tool_calls if call.index == 0]
        return message

    def stream_finish_reason(self, finish_reason: str) -> str:
        if self.tools_streamed and self.plan.mode != "named" and finish_reason == "stop":
            return "tool_calls"
        return finish_reason

