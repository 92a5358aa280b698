"""Which parsers read a chat request's answer: the model's reasoning parser (vLLM's `--reasoning-parser`)
and tool-call parser (`--tool-call-parser`, planned per request in `tool_calls.py`); `choice_output.py`
reads each choice with them. None of this applies to a server configured with neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.text import Tokenizer

from .protocol import ChatCompletionRequest
from .reasoning_parsers import REASONING_PARSERS, ReasoningParser, ReasoningSetup
from .tool_calls import ToolCallPlan


def reasoning_setup(name: str | None, tokenizer: Tokenizer) -> ReasoningSetup | None:
    """The configured reasoning parser bound to this model's tokenizer; a ValueError (a configuration
    error found at start) when the tokenizer lacks what it needs."""
    return None if name is None else REASONING_PARSERS[name](tokenizer)


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template kwargs vLLM builds a request's parser with (and sends its engine as
    `reasoning_parser_kwargs`): `build_chat_params` merging the request's own under its other fields (a
    field that is None is left out; this server takes no `documents`), `enable_thinking` following
    `reasoning_effort` unless given."""
    extra: dict[str, Any] = {
        "add_generation_prompt": request.add_generation_prompt,
        "continue_final_message": request.continue_final_message,
        "reasoning_effort": request.reasoning_effort,
    }
    own = request.chat_template_kwargs or {}
    if request.reasoning_effort is not None and "enable_thinking" not in own:
        extra["enable_thinking"] = request.reasoning_effort != "none"
    return own | {k: v for k, v in extra.items() if v is not None and v != "auto"}


@dataclass(frozen=True)
class OutputParsing:
    """How one chat request's answer is read."""

    tools: ToolCallPlan | None
    reasoning: ReasoningSetup | None
    # What the reasoning parser is built with (`template_kwargs`): Qwen3's `enable_thinking`.
    reasoning_kwargs: dict[str, Any]
    include_reasoning: bool
    # The prompt's last think tag is the end tag (the template closed the reasoning): a stream is all
    # content from its first token. True without a reasoning parser.
    prompt_ended_reasoning: bool

    def reasoning_parser(self) -> ReasoningParser | None:
        """A parser for one choice (one keeps state while streaming)."""
        return None if self.reasoning is None else self.reasoning.parser(self.reasoning_kwargs)


def output_parsing(
    request: ChatCompletionRequest, tools: ToolCallPlan | None, reasoning: ReasoningSetup | None, prompt_token_ids: list[int]
) -> OutputParsing | None:
    """None: no parser is configured, the answer is plain content. The prompt is read once here, for
    every choice's reader and for the engine request."""
    if tools is None and reasoning is None:
        return None
    kwargs = template_kwargs(request) if reasoning is not None else {}
    ended = reasoning is None or reasoning.parser(kwargs).is_reasoning_end(prompt_token_ids)
    return OutputParsing(tools, reasoning, kwargs, request.include_reasoning, ended)


def reasoning_ended(request: ChatCompletionRequest, parsing: OutputParsing | None) -> bool | None:
    """`EngineCoreRequest.reasoning_ended` (vLLM's `resolve_reasoning_ended`): where an engine with a
    reasoning parser starts applying structured outputs. True: from the first token; None: the engine
    looks at the prompt itself."""
    if not request.include_reasoning:
        return True
    if parsing is not None and parsing.reasoning is not None:
        return parsing.prompt_ended_reasoning
    return None
