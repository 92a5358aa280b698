"""Tools on chat requests: vLLM's checks of `tools` and `tool_choice`, and the tools the chat template sees.

Tools are rendered into the prompt by the model's chat template, as vLLM does for every `tool_choice`
(`--exclude-tools-when-tool-choice-none` is off by default). The calls the model writes are parsed only by
a tool-call parser, which this server does not have: like a `vllm serve` started without
`--tool-call-parser`, it answers `tool_choice` "none" (or null) with plain content and refuses "auto"
(also the default when tools are given), "required" and a named function with a 400.
"""

from __future__ import annotations

from .errors import OpenAIError, bad_request
from .protocol import ChatCompletionRequest

_AUTO_NEEDS_A_PARSER = (
    '"auto" tool choice requires a tool-call parser (vllm serve: --enable-auto-tool-choice and --tool-call-parser), '
    'and this server has none: send tool_choice "none" to have the tools in the prompt and the answer as plain content'
)
_CORRECT_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def check_tools(request: ChatCompletionRequest) -> None:
    """vLLM 0.32's `ChatCompletionRequest.check_tool_usage`, in its words, then the refusal of a server
    with no tool-call parser (vLLM's `OnlineRenderer`)."""
    if request.tools is not None and not request.tools:
        raise bad_request(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", "tools"
        )
    choice = request.tool_choice
    if "tool_choice" not in request.model_fields_set and request.tools:
        choice = "auto"  # vLLM's default when tools are given
    if choice is None or choice == "none":
        return
    if not request.tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise bad_request(
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are supported.',
                "tool_choice",
            )
        if choice == "auto":
            raise bad_request(_AUTO_NEEDS_A_PARSER, "tool_choice")
        raise _needs_a_parser(f'"{choice}"')
    name = _named_function(choice)
    if all(tool.function.name != name for tool in request.tools):
        raise bad_request("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")
    raise _needs_a_parser(f'function "{name}"')


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
