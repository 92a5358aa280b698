"""The structural tag that constrains the engine to a tool-call parser's format, as vLLM 0.32 builds it
(`DelegatingParser._apply_structural_tag`, `tool_parsers/structural_tag_registry.py`, with its defaults:
`VLLM_ENFORCE_STRICT_TOOL_CALLING` on, `--tool-strict-level auto`).

- `required`: one or more calls (`tags_with_separator`, at least one); a named function: exactly one call
  of it.
- `auto`: free text in which a call, once the model writes its start tag, must be well formed
  (`triggered_tags`); only when a tool is `strict` or `parallel_tool_calls` is false, else nothing.
- A call's arguments follow its `parameters` schema only when the tool is `strict`; else any JSON.
- `parallel_tool_calls: false` stops after the first call.
- `auto` with a structured-outputs constraint and a tag: either a call or the constraint's output.

The dicts are xgrammar's `StructuralTag(...).model_dump()`, every default field included: the engine gets
the same JSON text as from `vllm serve`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..protocol import ChatCompletionTool

_JSON_STYLE = {"style": "json", "any_order": False, "max_whitespace_cnt": None, "excludes": []}


def json_schema_format(schema: Any) -> dict:
    """xgrammar's `JSONSchemaFormat`."""
    return {"type": "json_schema", "json_schema": schema, **_JSON_STYLE}


def _parameters(tool: ChatCompletionTool, strict: bool) -> Any:
    """vLLM's `get_function_parameters` of a tool whose `strict` was pinned to `strict`."""
    if not strict:
        return True
    return tool.function.parameters if tool.function.parameters is not None else True


def _hermes_tags(tools: list[tuple[ChatCompletionTool, bool]]) -> list[dict]:
    formats = (("<tool_call>\n{\"name\": \"", "}\n</tool_call>"), ("<tool_call>{\"name\": \"", "}</tool_call>"))
    return [
        {
            "type": "tag",
            "begin": begin + tool.function.name + '", "arguments": ',
            "content": json_schema_format(_parameters(tool, strict)),
            "end": end,
        }
        for tool, strict in tools
        for begin, end in formats
    ]


def _hermes_format(tools: list[tuple[ChatCompletionTool, bool]], mode: str, single_call: bool) -> dict:
    tags = _hermes_tags(tools)
    if mode == "auto":
        if not tags:
            return {"type": "any_text", "excludes": [], "max_tokens": None, "max_chars": None}
        return {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags, "at_least_one": False,
                "stop_after_first": single_call, "excludes": []}  # fmt: skip
    return {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
            "stop_after_first": single_call or mode == "forced"}  # fmt: skip


FORMATS = {"hermes": _hermes_format}


def tool_call_structural_tag(
    model: str,
    tools: list[ChatCompletionTool],
    tool_choice: str | dict,
    parallel_tool_calls: bool | None,
    output_format: Callable[[], dict] | None,
) -> str | None:
    """The `structural_tag` the engine gets (JSON text as vLLM sends it), or None for none.
    `tool_choice`: "auto", "required" or a named function (checked before); `output_format`: the
    request's structured-outputs constraint as an xgrammar format, None if it has none (read only for
    `auto` with a tag)."""
    is_auto = tool_choice == "auto"
    single_call = parallel_tool_calls is False
    # --tool-strict-level auto, raised to "function" by parallel_tool_calls false (not for auto with
    # structured outputs, whose format-only grammar must not make calls possible that are not otherwise).
    enveloped = single_call and not (is_auto and output_format is not None)
    if is_auto and not enveloped and not any(tool.function.strict is True for tool in tools):
        return None
    alternative = output_format() if is_auto and output_format is not None else None
    pinned = [(tool, tool.function.strict is True) for tool in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        pinned, mode = [(tool, strict) for tool, strict in pinned if tool.function.name == name], "forced"
    else:
        # auto with a constraint: a call (at least one) or the constraint's output.
        mode = "required" if (tool_choice == "required" or alternative is not None) else "auto"
    tag_format = FORMATS[model](pinned, mode, single_call)
    if alternative is not None:
        tag_format = {"type": "or", "elements": [tag_format, alternative]}
    return json.dumps({"type": "structural_tag", "format": tag_format})
