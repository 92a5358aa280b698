"""Which parsers read a chat request's answer: the model's reasoning parser (vLLM's `--reasoning-parser`)
and tool-call parser (`--tool-call-parser`, planned per request in `tool_calls.py`); `choice_output.py`
reads each choice with them. None of this applies to a server configured with neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.text import Tokenizer

from .protocol import ChatCompletionRequest
from .reasoning_parsers import REASONING_PARSERS, ReasoningParser, ThinkTagReasoningParser
from .tool_calls import ToolCallPlan


@dataclass(frozen=True)
class ReasoningSetup:
    """A reasoning parser with the ids of its tags in the model's vocabulary, found once per model."""

    parser_class: type[ThinkTagReasoningParser]
    start_token_id: int
    end_token_id: int

    def parser(self) -> ReasoningParser:
        return self.parser_class(self.start_token_id, self.end_token_id)


def reasoning_setup(name: str | None, tokenizer: Tokenizer) -> ReasoningSetup | None:
    """The configured reasoning parser for this model's tokenizer; a ValueError (a configuration error
    found at start, where vLLM fails every request) when the tokenizer lacks its tags as tokens."""
    if name is None:
        return None
    parser_class = REASONING_PARSERS[name]
    start, end = tokenizer.token_to_id(parser_class.start_token), tokenizer.token_to_id(parser_class.end_token)
    if start is None or end is None:
        raise ValueError(
            f"reasoning_parser {name!r} needs {parser_class.start_token} and {parser_class.end_token} as tokens "
            "of the model's tokenizer, and this tokenizer has no such tokens"
        )
    return ReasoningSetup(parser_class, start, end)


@dataclass(frozen=True)
class OutputParsing:
    """How one chat request's answer is read."""

    tools: ToolCallPlan | None
    reasoning: ReasoningSetup | None
    include_reasoning: bool
    # The prompt's last think tag is the end tag (the template closed the reasoning): a stream is all
    # content from its first token. True without a reasoning parser.
    prompt_ended_reasoning: bool


def output_parsing(
    request: ChatCompletionRequest, tools: ToolCallPlan | None, reasoning: ReasoningSetup | None, prompt_token_ids: list[int]
) -> OutputParsing | None:
    """None: no parser is configured, the answer is plain content. The prompt is read once here, for
    every choice's reader and for the engine request."""
    if tools is None and reasoning is None:
        return None
    ended = reasoning is None or reasoning.parser().is_reasoning_end(prompt_token_ids)
    return OutputParsing(tools, reasoning, request.include_reasoning, ended)


def reasoning_ended(request: ChatCompletionRequest, parsing: OutputParsing | None) -> bool | None:
    """`EngineCoreRequest.reasoning_ended` (vLLM's `resolve_reasoning_ended`): where an engine with a
    reasoning parser starts applying structured outputs. True: from the first token; None: the engine
    looks at the prompt itself."""
    if not request.include_reasoning:
        return True
    if parsing is not None and parsing.reasoning is not None:
        return parsing.prompt_ended_reasoning
    return None
