"""Tools in the chat prompt, against vLLM's own path: the tool dicts the template sees equal vLLM's
`ChatCompletionToolsParam.model_dump()`, and prompts with tools and a tool-call history (assistant
`tool_calls`, `tool` messages) render as transformers' `apply_chat_template(tools=...)` renders vLLM's
conversation. The template is the tiny Qwen2-VL's (tests/support/tiny_models.py): Qwen2-VL's plus a
Hermes-format tools branch; the real-engine comparison is tests/e2e/test_real_vllm_tools.py."""

from __future__ import annotations

import json

import pytest

from mmserve.openai.protocol import ChatCompletionRequest, ChatCompletionTool
from mmserve.openai.tool_calls import template_tools
from mmserve.text import ChatTemplate, ConversationMessage, MediaContent, ModelFiles, TextContent, Tokenizer, ToolCall
from tests.support.tiny_models import qwen2_vl_template_with_tools
from tests.text.conftest import BUILTIN_DIR
from tests.text.test_chat_template import PLACEHOLDERS, _vllm_conversation

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city — in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "東京"]}},
                       "required": ["city"]},
    },
}  # fmt: skip
TOOL_SPECS = {
    "full": WEATHER,
    "name-only": {"type": "function", "function": {"name": "ping"}},
    "strict": {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}},
    "strict-false": {"type": "function", "function": {"name": "f", "strict": False}},
    "unknown-keys-dropped": {"type": "function", "function": {"name": "f", "x-extra": 1}, "also": 2},
    "keys-out-of-order": {"function": {"parameters": {"b": 1, "a": {"z": None, "y": [1, "2"]}}, "name": "g"}},
}

CONVERSATIONS = {
    "ask": [ConversationMessage("user", "What is the weather in Paris?")],
    "system-and-ask": [ConversationMessage("system", "Be brief."), ConversationMessage("user", "Weather?")],
    "history": [
        ConversationMessage("user", [TextContent("Weather here?"), MediaContent("image")]),
        ConversationMessage("assistant", None, tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        ConversationMessage("tool", "sunny, 22 °C", tool_call_id="call_1"),
        ConversationMessage("assistant", "Sunny."),
        ConversationMessage("user", "And tomorrow?"),
    ],
    "parallel-calls-and-parts": [
        ConversationMessage("user", "Both cities?"),
        ConversationMessage("assistant", "Checking.", tool_calls=(
            ToolCall("a", "get_weather", '{"city": "Paris"}'), ToolCall("b", "get_weather", '{"city": "東京"}'),
        )),  # fmt: skip
        ConversationMessage("tool", [TextContent("rain"), TextContent("12")], tool_call_id="a"),
        ConversationMessage("tool", "snow", tool_call_id="b"),
    ],
    "bad-arguments-become-empty": [
        ConversationMessage("user", "x"),
        ConversationMessage("assistant", "", tool_calls=(ToolCall("c", "ping", "not json"), ToolCall("d", "ping", "[1]"))),
        ConversationMessage("user", "again"),
    ],
}


@pytest.mark.parametrize("spec", TOOL_SPECS.values(), ids=TOOL_SPECS)
def test_tool_dicts_equal_vllm_model_dump(spec):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    ours = ChatCompletionTool.model_validate(spec).template_dict()
    vllm = ChatCompletionToolsParam.model_validate(spec).model_dump()
    # Key order too: the template writes them with tojson.
    assert json.dumps(ours, ensure_ascii=False) == json.dumps(vllm, ensure_ascii=False)


@pytest.fixture(scope="module")
def tools_template():
    files = ModelFiles.load(BUILTIN_DIR)
    source = qwen2_vl_template_with_tools(files.chat_template.text)
    template = ChatTemplate(source, dict(files.tokenizer_config.named_special_tokens), placeholders=PLACEHOLDERS["qwen"])
    return template, Tokenizer.from_model_files(files)


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no-tools"])
def test_tools_and_history_render_as_vllm(tools_template, name, with_tools):
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    template, tokenizer = tools_template
    messages = CONVERSATIONS[name]
    specs = list(TOOL_SPECS.values())
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": specs if with_tools else None}
    )
    ours = template.render(messages, tools=template_tools(request))
    hf = AutoTokenizer.from_pretrained(str(BUILTIN_DIR))
    conversation = _vllm_conversation(messages, template.content_format, PLACEHOLDERS["qwen"])
    vllm_tools = [ChatCompletionToolsParam.model_validate(s).model_dump() for s in specs] if with_tools else None
    expected = hf.apply_chat_template(
        conversation, tools=vllm_tools, chat_template=template.source, tokenize=False, add_generation_prompt=True,
        documents=None, reasoning_effort=None,
    )  # fmt: skip
    assert ours == expected
    if with_tools:
        assert '"name": "get_weather"' in ours and "<tools>" in ours
        if name == "history":
            assert "<tool_response>\nsunny, 22 °C\n</tool_response>" in ours
    else:
        assert "<tools>" not in ours
    assert tokenizer.encode(ours, add_special_tokens=False) == hf.encode(expected, add_special_tokens=False)
