"""`mmserve.openai.tool_calls`: vLLM's checks of `tools` and `tool_choice` in its words, the refusals of a
server without a tool-call parser or without auto tool choice, and the tool choice each request is read
with. `test_refusals_word_for_word_as_vllm` runs vLLM's own request model on the same bodies (reference venv)."""

from __future__ import annotations

import pytest

from mmserve.openai.errors import OpenAIError
from mmserve.openai.protocol import ChatCompletionRequest
from mmserve.openai.settings import ToolCallSettings
from mmserve.openai.tool_calls import check_tools, template_tools

NO_PARSER = ToolCallSettings(parser=None, enable_auto_tool_choice=False)
HERMES = ToolCallSettings(parser="hermes", enable_auto_tool_choice=True)
HERMES_WITHOUT_AUTO = ToolCallSettings(parser="hermes", enable_auto_tool_choice=False)

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "hi"}]

# body fields -> the param named, for requests vLLM's request model itself refuses (check_tool_usage)
VLLM_REFUSES = {
    "empty-tools": ({"tools": []}, "tools"),
    "choice-without-tools": ({"tool_choice": "auto"}, "tool_choice"),
    "named-without-tools": ({"tool_choice": NAMED}, "tool_choice"),
    "unknown-word": ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    "named-unknown-function": ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
    "function-missing": ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    "function-not-object": ({"tools": [TOOL], "tool_choice": {"type": "function", "function": "f"}}, "tool_choice.function"),
    "name-missing": ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    "name-empty": ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": ""}}}, "tool_choice.function.name"),
}
# Requests vLLM's request model takes, and a server without a tool-call parser refuses: the tool choice
# a server with one reads them with.
NEEDS_A_PARSER = {
    "default-auto": ({"tools": [TOOL]}, "auto"),
    "auto": ({"tools": [TOOL], "tool_choice": "auto"}, "auto"),
    "required": ({"tools": [TOOL], "tool_choice": "required"}, "required"),
    "named": ({"tools": [TOOL], "tool_choice": NAMED}, "named"),
}
SERVED = {
    "no-tools": ({}, "none"),
    "none": ({"tools": [TOOL], "tool_choice": "none"}, "none"),
    "null": ({"tools": [TOOL], "tool_choice": None}, "null"),
    "none-without-tools": ({"tool_choice": "none"}, "none"),
    "null-without-tools": ({"tool_choice": None}, "none"),
}


def _request(fields: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def _refusal(fields: dict, config: ToolCallSettings = NO_PARSER) -> OpenAIError:
    with pytest.raises(OpenAIError) as refused:
        check_tools(_request(fields), config)
    assert refused.value.status == 400
    return refused.value


@pytest.mark.parametrize("config", [NO_PARSER, HERMES], ids=["no-parser", "hermes"])
@pytest.mark.parametrize("name", VLLM_REFUSES)
def test_vllm_refusals_name_the_field(name, config):
    fields, param = VLLM_REFUSES[name]
    assert _refusal(fields, config).param == param


@pytest.mark.parametrize("name", NEEDS_A_PARSER)
def test_what_needs_a_parser_is_refused_naming_tool_choice(name):
    error = _refusal(NEEDS_A_PARSER[name][0])
    assert error.param == "tool_choice" and "requires a tool-call parser" in error.message


@pytest.mark.parametrize("name", NEEDS_A_PARSER)
def test_a_parser_serves_them_and_auto_needs_enabling(name):
    fields, mode = NEEDS_A_PARSER[name]
    assert check_tools(_request(fields), HERMES) == mode
    if mode == "auto":
        error = _refusal(fields, HERMES_WITHOUT_AUTO)
        assert error.param == "tool_choice" and "requires enable_auto_tool_choice" in error.message
    else:
        assert check_tools(_request(fields), HERMES_WITHOUT_AUTO) == mode


@pytest.mark.parametrize("config", [NO_PARSER, HERMES], ids=["no-parser", "hermes"])
@pytest.mark.parametrize("name", SERVED)
def test_none_and_null_are_served_with_the_tools_in_the_prompt(name, config):
    fields, mode = SERVED[name]
    request = _request(fields)
    assert check_tools(request, config) == mode
    tools = template_tools(request)
    assert tools == ([{"type": "function", "function": {"name": "get_weather", "description": None, "parameters": {"type": "object"}}}]
                     if request.tools else None)  # fmt: skip


def test_refusals_word_for_word_as_vllm():
    """vLLM's `ChatCompletionRequest` refuses the same bodies with the same messages; it takes the
    ones that need a parser (vLLM refuses those later, in its renderer) and the served ones."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChatRequest
    from vllm.exceptions import VLLMValidationError

    for name, (fields, _) in VLLM_REFUSES.items():
        with pytest.raises((ValueError, VLLMValidationError)) as vllm_refused:
            VllmChatRequest.model_validate({"messages": MESSAGES, **fields})
        assert _refusal(fields).message in str(vllm_refused.value), name
    for fields, _ in [*NEEDS_A_PARSER.values(), *SERVED.values()]:
        VllmChatRequest.model_validate({"messages": MESSAGES, **fields})


def _constraints(fields: dict):
    from mmserve.openai.structured_outputs import structured_outputs
    from mmserve.openai.tool_calls import engine_tool_constraints, tool_call_plan

    request = _request(fields)
    plan = tool_call_plan(request, check_tools(request, HERMES), HERMES)
    return engine_tool_constraints(request, plan, structured_outputs(request))


STRICT = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {"type": "object"}}}


def test_a_strict_tools_schema_is_checked_before_it_reaches_the_engine():
    with pytest.raises(OpenAIError) as refused:
        _constraints({"tools": [{**STRICT, "function": {**STRICT["function"], "parameters": {"type": "nonsense"}}}],
                      "tool_choice": "required"})  # fmt: skip
    assert refused.value.status == 400 and refused.value.param == "tools"


def test_auto_with_a_strict_tool_and_a_grammar_takes_ebnf_and_refuses_lark():
    skip, sent = _constraints({"tools": [STRICT], "structured_outputs": {"grammar": 'root ::= "a"'}})
    assert skip is False and '"grammar": "root ::= \\"a\\""' in sent.structural_tag
    with pytest.raises(OpenAIError) as refused:
        _constraints({"tools": [STRICT], "structured_outputs": {"grammar": 'start: "a"'}})
    assert refused.value.status == 400 and refused.value.param == "structured_outputs" and "Lark" in refused.value.message
    # Without a strict tool no tag is built, and the Lark grammar constrains the answer as it is.
    skip, sent = _constraints({"tools": [TOOL], "structured_outputs": {"grammar": 'start: "a"'}})
    assert sent.grammar == 'start: "a"' and sent.structural_tag is None


def test_strict_schemas_and_the_structural_tag_are_parsed_by_the_engines_compiler(monkeypatch):
    """A strict tool's schema that only the grammar compiler refuses (a `$ref` to nothing): a 400 naming
    `tools`, as vLLM's front end refuses the structural tag that embeds it; and the tag itself is parsed
    too, before sending (shown with the schema check taken out)."""
    from mmserve.openai import tool_calls

    broken = {"type": "object", "properties": {"city": {"$ref": "#/$defs/missing"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": broken}}
    for choice in ("required", NAMED, "auto"):
        with pytest.raises(OpenAIError) as refused:
            _constraints({"tools": [tool], "tool_choice": choice})
        assert refused.value.status == 400 and refused.value.param == "tools", choice
        assert "missing" in refused.value.message, refused.value.message
    monkeypatch.setattr(tool_calls, "check_json_schema", lambda spec, param: spec)
    with pytest.raises(OpenAIError) as refused:
        _constraints({"tools": [tool], "tool_choice": "required"})
    assert refused.value.param == "tools" and "structural tag" in refused.value.message
    # The same tool, its schema whole, is sent.
    fixed = {**tool, "function": {**tool["function"], "parameters": {**broken, "$defs": {"missing": {"type": "string"}}}}}
    _, sent = _constraints({"tools": [fixed], "tool_choice": "required"})
    assert sent.structural_tag is not None and "#/$defs/missing" in sent.structural_tag
