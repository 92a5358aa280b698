"""One choice's answer read by the model's parsers, whole or streamed: vLLM 0.32's `DelegatingParser`
(reasoning first, then tool calls in what follows it) and the parser branches of its chat serving, for a
server with a reasoning parser, a tool-call parser or both.

Reasoning: a whole answer is split by the reasoning parser alone (vLLM does not look at the prompt
there); a stream starts after the reasoning when the prompt already ended it (the chat template closed
the think tags), and otherwise splits each delta until the end tag, the tool-call parser then reading
only what follows. `include_reasoning: false` drops the reasoning (a streamed delta that only had
reasoning is not sent) and, as vLLM does whenever a parser is on, hides logprobs and token ids.

Tool calls: a whole answer is parsed when `tool_choice` may call tools and auto tool choice is enabled
(vLLM's Hermes-style parsers, constrained by structural tags, read `required` and named answers as
`auto` ones); the message gets the calls, and `finish_reason` "tool_calls" for `auto` calls and for
`required` answers that stopped. Streamed: every delta goes through the parser, which sends nothing
until it has something (a delta with no text is not sent, unless it finishes the choice or carries
logprobs or token ids), and `finish_reason` is "tool_calls" when calls were streamed and the function
was not named. `parallel_tool_calls: false` keeps the first call.
"""

from __future__ import annotations

from dataclasses import dataclass

from msgspec import UNSET

from .message_delta import MessageDelta
from .reasoning_parsers import ReasoningParser
from .output_parsing import OutputParsing
from .tool_parsers import ParsedToolCall


@dataclass
class WholeAnswer:
    """What a choice's message and finish reason become."""

    reasoning: str | None
    content: str | None
    # None: the message has no `tool_calls`; a list (maybe empty) for `required` and named choices.
    tool_calls: list[ParsedToolCall] | None
    finish_reason: str | None


class ChoiceOutput:
    """One choice's reading (the parsers keep state while streaming)."""

    def __init__(self, parsing: OutputParsing) -> None:
        self.parsing = parsing
        self.tools = parsing.tools
        self.tool_parser = None if parsing.tools is None else parsing.tools.parser()
        self.reasoning: ReasoningParser | None = parsing.reasoning_parser()
        # Streaming state, vLLM's `StreamState`: the ids so far are kept only while reasoning lasts.
        self._reasoning_ended = parsing.prompt_ended_reasoning
        self._previous_ids: list[int] = []
        self._tool_text = ""  # the text the tool-call parser has read (it re-reads it whole, as vLLM's does)
        self.tools_streamed = False

    @property
    def shows_metadata(self) -> bool:
        """vLLM hides logprobs and token ids when `include_reasoning` is false and a parser is on."""
        return self.parsing.include_reasoning

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        return 0 if self.reasoning is None else self.reasoning.count_reasoning_tokens(token_ids)

    # ------------------------------------------------------------------ whole answers

    def tool_calls_of(self, text: str | None) -> tuple[list[ParsedToolCall] | None, str | None]:
        """vLLM's `DelegatingParser._extract_tool_calls` for a parser without required/named support."""
        plan = self.tools
        if plan is None or plan.mode == "none" or not plan.enable_auto_tool_choice:
            return [], text
        assert self.tool_parser is not None
        info = self.tool_parser.extract_tool_calls(text or "")
        if info.tools_called:
            content = info.content
            return info.tool_calls, None if content is not None and not content.strip() else content
        if plan.mode in ("required", "named") and not (text or "").strip():
            return [], None
        return None, text

    def whole(self, text: str, finish_reason: str | None) -> WholeAnswer:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.extract_reasoning(text)
        if not self.parsing.include_reasoning:
            reasoning = None
        calls, content = self.tool_calls_of(content)
        mode = None if self.tools is None else self.tools.mode
        if mode in ("required", "named"):
            answer = WholeAnswer(reasoning, content or "", list(calls or []), finish_reason)
            if mode == "required" and finish_reason == "stop":
                answer.finish_reason = "tool_calls"
        elif mode == "auto" and self.tools is not None and self.tools.enable_auto_tool_choice and calls:
            answer = WholeAnswer(reasoning, content, calls, "tool_calls")
        else:  # no tools, none, null, or auto without calls
            answer = WholeAnswer(reasoning, content, None, finish_reason)
        if answer.tool_calls and self.tools is not None and self.tools.parallel_tool_calls is False:
            answer.tool_calls = answer.tool_calls[:1]
        return answer

    # ------------------------------------------------------------------ streams

    def delta(self, delta_text: str, delta_token_ids: list[int], finished: bool) -> MessageDelta | None:
        """vLLM's `DelegatingParser.parse_delta`: the delta a chunk shows, or None."""
        message: MessageDelta | None = None
        transitioned = False
        reasoning = self.reasoning
        if reasoning is not None and not self._reasoning_ended:
            message = reasoning.extract_reasoning_streaming(delta_text, self._previous_ids, delta_token_ids)
            if reasoning.engine_based:
                ended = reasoning.has_engine_confirmed_reasoning_end()
            else:
                ended = reasoning.is_reasoning_end_streaming(self._previous_ids, delta_token_ids)
            if ended:
                self._reasoning_ended = transitioned = True
                self._previous_ids = []
                # What follows the end in this delta is where the tool-call parser starts; an engine-based
                # parser gives up what it held back (a partial terminal, whitespace) now, as it is not fed again.
                delta_text = _text(message)
                if reasoning.engine_based:
                    delta_text += _text(reasoning.finish_streaming())
                    if self.tools is None and delta_text:  # no tool phase to read it: content now
                        message = message if message is not None else MessageDelta()
                        message.content = delta_text
            else:
                self._previous_ids += delta_token_ids
        in_tool_phase = self.tools is not None and self._reasoning_ended
        if in_tool_phase:
            reasoning_of_this_delta = None if message is None else message.reasoning
            message = self._tool_delta(delta_text, finished)
            if reasoning_of_this_delta:
                if message is None:
                    message = MessageDelta(reasoning=reasoning_of_this_delta)
                elif not message.reasoning:
                    message.reasoning = reasoning_of_this_delta
        elif message is None and not transitioned and self._reasoning_ended:
            message = MessageDelta.of_content(delta_text)
        if finished and reasoning is not None and reasoning.engine_based and not self._reasoning_ended:
            message = _merged(message, reasoning.finish_streaming())
        if message is not None and not self.parsing.include_reasoning:
            message.reasoning = None  # vLLM sets it to null: a chunk then shows `"reasoning": null`
            if not message.content and not message.tool_calls:
                message = None
        return message

    def _tool_delta(self, delta_text: str, finished: bool) -> MessageDelta | None:
        """The tool-call phase: `_extract_tool_calls_streaming`, then the unstreamed arguments at the end."""
        plan = self.tools
        assert plan is not None and self.tool_parser is not None
        if plan.mode == "none":
            return MessageDelta.of_content(delta_text) if delta_text else None
        self._tool_text += delta_text
        parsed = self.tool_parser.extract_tool_calls_streaming(self._tool_text)
        if parsed is None:
            return None
        if parsed.tool_calls:
            self.tools_streamed = True
            if finished and (last := parsed.tool_calls[-1]).function is not None:
                last.function.arguments = (last.function.arguments or "") + self.tool_parser.remaining_unstreamed_args()
            if plan.parallel_tool_calls is False:
                parsed.tool_calls = [call for call in parsed.tool_calls if call.index == 0]
        return MessageDelta.of_tool_parser(parsed)

    def stream_finish_reason(self, finish_reason: str) -> str:
        if self.tools_streamed and self.tools is not None and self.tools.mode != "named" and finish_reason == "stop":
            return "tool_calls"
        return finish_reason


def _text(delta: MessageDelta | None) -> str:
    """A delta's content, "" when it has none."""
    return delta.content if delta is not None and isinstance(delta.content, str) else ""


def _merged(message: MessageDelta | None, flushed: MessageDelta | None) -> MessageDelta | None:
    """vLLM's `_flush_engine_parsers`: what the parser held back, appended to the stream's last delta."""
    if flushed is None:
        return message
    if message is None:
        return flushed
    if _text(flushed):
        message.content = _text(message) + _text(flushed)
    if isinstance(flushed.reasoning, str) and flushed.reasoning:
        message.reasoning = (message.reasoning if isinstance(message.reasoning, str) else "") + flushed.reasoning
    return message


__all__ = ["UNSET", "ChoiceOutput", "WholeAnswer"]
