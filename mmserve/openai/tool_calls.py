"""Tools on chat requests: vLLM's checks of `tools` and `tool_choice`, the tools the chat template sees,
and what a request that may call tools asks of the engine.

Tools are rendered into the prompt by the model's chat template, as vLLM does for every `tool_choice`
(`--exclude-tools-when-tool-choice-none` is off by default). The calls the model writes are parsed by
the model's tool-call parser (`tool_call_parser`, vLLM's `--tool-call-parser`; `tool_parsers/`), and
`"auto"` needs `enable_auto_tool_choice` too, as in vLLM. Without a parser, `tool_choice` "none" (or
null) is served as plain content and the others are refused with a 400, as a `vllm serve` started
without `--tool-call-parser` refuses them.

With a parser, a request whose tools may be called keeps special tokens in its text (the call markers
are special tokens in some tokenizers) and gets the parser's structural tag (`structural_tags.py`) in
place of its own structured outputs, where vLLM puts one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from mmserve.wire import StructuredOutputsParams

from . import grammar_check
from .errors import OpenAIError, bad_request
from .protocol import ChatCompletionRequest
from .settings import ToolCallSettings
from .structured_outputs import STRUCTURED_BACKEND, check_json_schema, check_with_compiler
from .tool_parsers import TOOL_CALL_PARSERS, ToolCallParser
from .tool_parsers.structural_tags import json_schema_format, tool_call_structural_tag

_AUTO_NEEDS_A_PARSER = (
    '"auto" tool choice requires a tool-call parser (vllm serve: --enable-auto-tool-choice and --tool-call-parser), '
    'and this server has none: send tool_choice "none" to have the tools in the prompt and the answer as plain content'
)
_AUTO_NEEDS_ENABLING = (
    '"auto" tool choice requires enable_auto_tool_choice in this model\'s configuration '
    "(vllm serve: --enable-auto-tool-choice and --tool-call-parser)"
)
_CORRECT_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'

# The request's `tool_choice` as the answer is built from it: "null" is an explicit null with tools
# (vLLM parses calls then, but answers as "none" does), "none" also stands for no tools at all.
ToolChoiceMode = Literal["none", "null", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolCallPlan:
    """How one chat request's answer is parsed for tool calls (`choice_output.py`)."""

    parser: type[ToolCallParser]
    enable_auto_tool_choice: bool
    mode: ToolChoiceMode
    parallel_tool_calls: bool | None


def check_tools(request: ChatCompletionRequest, config: ToolCallSettings) -> ToolChoiceMode:
    """vLLM 0.32's `ChatCompletionRequest.check_tool_usage`, in its words, then the refusals of a server
    without the parser or the auto tool choice the request needs (vLLM's `OnlineRenderer`)."""
    if request.tools is not None and not request.tools:
        raise bad_request(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", "tools"
        )
    choice = request.tool_choice
    so = request.structured_outputs
    constrained = so is not None and any(v is not None for v in (so.json_schema, so.regex, so.choice))
    if constrained and "tool_choice" in request.model_fields_set and choice not in ("none", "auto", "required"):
        # vLLM's `check_structured_outputs_count` (a named function, or an explicit null).
        raise bad_request("You can only either use constraints for structured outputs or tools, not both.", "tool_choice")
    if "tool_choice" not in request.model_fields_set and request.tools:
        choice = "auto"  # vLLM's default when tools are given
    if choice == "none" or not request.tools and choice is None:
        return "none"
    if choice is None:
        return "null"
    if not request.tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise bad_request(
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are supported.',
                "tool_choice",
            )
        if choice == "auto" and config.parser is None:
            raise bad_request(_AUTO_NEEDS_A_PARSER, "tool_choice")
        if choice == "auto" and not config.enable_auto_tool_choice:
            raise bad_request(_AUTO_NEEDS_ENABLING, "tool_choice")
        if config.parser is None:
            raise _needs_a_parser(f'"{choice}"')
        return choice  # type: ignore[return-value]
    name = _named_function(choice)
    if all(tool.function.name != name for tool in request.tools):
        raise bad_request("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")
    if config.parser is None:
        raise _needs_a_parser(f'function "{name}"')
    return "named"


def _named_function(choice: dict) -> str:
    """The function a named `tool_choice` names, its shape checked as vLLM checks it."""
    # vLLM's messages show the Python values (`None`, not `null`).
    function = choice.get("function")
    if not isinstance(function, dict):
        raise bad_request(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_NAMED_USAGE}",
            "tool_choice.function",
        )
    name = function.get("name")
    if "name" not in function:
        raise bad_request(f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_NAMED_USAGE}", "tool_choice.function.name")
    if not isinstance(name, str) or not name:
        raise bad_request(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_NAMED_USAGE}",
            "tool_choice.function.name",
        )
    if choice.get("type", "function") != "function":
        raise bad_request("`tool_choice.type` must be \"function\"", "tool_choice.type")
    return name


def _needs_a_parser(described: str) -> OpenAIError:
    """The refusal of `tool_choice` "required" or a named function (`described`: `"required"`,
    `function "NAME"`)."""
    return bad_request(
        f"tool_choice={described} requires a tool-call parser (vllm serve: --tool-call-parser), and this server has none",
        "tool_choice",
    )


def template_tools(request: ChatCompletionRequest) -> list[dict] | None:
    """The `tools` the chat template is rendered with (None when the request has none)."""
    if not request.tools:
        return None
    return [tool.template_dict() for tool in request.tools]


def tool_call_plan(request: ChatCompletionRequest, mode: ToolChoiceMode, config: ToolCallSettings) -> ToolCallPlan | None:
    """How the answer is parsed: None without a parser (plain content)."""
    if config.parser is None:
        return None
    return ToolCallPlan(TOOL_CALL_PARSERS[config.parser], config.enable_auto_tool_choice, mode, request.parallel_tool_calls)


def engine_tool_constraints(
    request: ChatCompletionRequest, plan: ToolCallPlan, structured: StructuredOutputsParams | None
) -> tuple[bool, StructuredOutputsParams | None] | None:
    """What a request that may call tools changes in its sampling, as vLLM's parser `adjust_request`
    does: (skip_special_tokens, structured outputs), or None when nothing changes."""
    if plan.mode == "none":
        return None
    skip_special_tokens = request.skip_special_tokens and not plan.parser.keeps_special_tokens
    if plan.mode == "null":
        return skip_special_tokens, structured
    assert request.tools is not None
    for tool in request.tools:
        if tool.function.strict is True and tool.function.parameters is not None:
            check_json_schema(tool.function.parameters, "tools")  # its schema constrains the engine
    tag = tool_call_structural_tag(
        plan.parser.structural_tag_model, request.tools,
        request.tool_choice if plan.mode == "named" else plan.mode,  # type: ignore[arg-type]
        plan.parallel_tool_calls, None if structured is None else lambda: _output_format(request, structured),
    )  # fmt: skip
    if tag is None:
        return skip_special_tokens, structured
    check_with_compiler(grammar_check.check_structural_tag, tag, "tools", "the tool calls' structural tag")
    return skip_special_tokens, StructuredOutputsParams(structural_tag=tag, _backend=STRUCTURED_BACKEND, _backend_was_auto=True)


def _output_format(request: ChatCompletionRequest, structured: StructuredOutputsParams) -> dict:
    """The request's structured-outputs constraint as an xgrammar format (vLLM's
    `structured_outputs_to_format`), for `auto` with a tag: a call, or output of that constraint."""
    if structured.json_object:
        return json_schema_format({"type": "object"})
    if structured.json is not None:
        return json_schema_format(json.loads(structured.json) if isinstance(structured.json, str) else structured.json)
    if structured.regex is not None:
        return {"type": "regex", "pattern": structured.regex}
    so = request.structured_outputs
    if so is not None and so.choice:
        return {"type": "or", "elements": [{"type": "const_string", "value": choice} for choice in so.choice]}
    assert structured.grammar is not None
    if "::=" not in structured.grammar:
        # vLLM converts Lark to EBNF with xgrammar first; this server does not.
        raise bad_request(
            'a Lark grammar together with tool_choice "auto" and a strict tool (or parallel_tool_calls false) '
            "is not supported by this server: write the grammar as EBNF",
            "structured_outputs",
        )
    return {"type": "grammar", "grammar": structured.grammar}
