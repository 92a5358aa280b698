"""Tools against `vllm serve` (started in this run on the same tiny Qwen2-VL, whose chat template renders
tools: tests/support/tiny_models.py): with `tool_choice` "none" or null, requests carrying tools and a
tool-call history (assistant `tool_calls`, `tool` messages) get the same prompt token ids, tokens, text
and finish reasons from mmserve as from `vllm serve`, streamed and not; and what a `vllm serve` with no
`--tool-call-parser` refuses, mmserve refuses too (every `tools` entry of the bad-request corpus is a
400 from both), with the engine still serving afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.bad_requests.corpus import CORPUS
from tests.e2e.test_real_vllm_e2e import _chat, _stream_chat

pytestmark = [pytest.mark.real_engine, pytest.mark.serve]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "now", "strict": False}}
HISTORY = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}},
    ]},  # fmt: skip
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "12 °C"}]},
]
GREEDY = {"temperature": 0.0, "max_tokens": 16}
CASES = {
    "tools-none": ([{"role": "user", "content": "What is the weather in Paris?"}], {"tools": [WEATHER, CLOCK], "tool_choice": "none"}),
    "tools-null-choice": ([{"role": "user", "content": "And the time?"}], {"tools": [CLOCK], "tool_choice": None}),
    "history-with-tools": (HISTORY, {"tools": [WEATHER], "tool_choice": "none"}),
    "history-without-tools": (HISTORY, {}),
}


@pytest.fixture(scope="module")
def references(vllm_serve_reference):
    return dict(zip(CASES, vllm_serve_reference.answers(
        [{"messages": messages, "sampling": {**GREEDY, **fields}} for messages, fields in CASES.values()]
    )))  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_tool_requests_equal_vllm_serve(vllm_app, references, name):
    messages, fields = CASES[name]
    ref = references[name]
    ours = _chat(vllm_app, messages, **GREEDY, **fields)
    assert ours.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    choice = ours.choices[0]
    assert (choice.model_extra["token_ids"], choice.message.content, choice.finish_reason) == (
        ref.outputs[0].token_ids, ref.outputs[0].text, ref.outputs[0].finish_reason
    )
    assert not choice.message.tool_calls


def test_tool_requests_stream_as_vllm_serve(vllm_app, references):
    messages, fields = CASES["history-with-tools"]
    ref = references["history-with-tools"]
    prompt_ids, texts, ids, finish, _, _ = _stream_chat(vllm_app, messages, **GREEDY, **fields)
    assert (prompt_ids, ids[0], texts[0], finish[0]) == (
        ref.prompt_token_ids, ref.outputs[0].token_ids, ref.outputs[0].text, ref.outputs[0].finish_reason
    )


def test_tools_in_the_prompt(references):
    """The tools are in the prompt (the comparison above would pass if both ignored them)."""
    with_tools, without = references["history-with-tools"], references["history-without-tools"]
    assert len(with_tools.prompt_token_ids) > len(without.prompt_token_ids) + 40


TOOL_CASES = [case for case in CORPUS if case.category == "tools"]
# mmserve validates request types strictly (mmserve/openai/protocol.py); vLLM's pydantic models coerce
# "yes" to true, and serve it.
STRICTER_THAN_VLLM = {"tools-tool-strict-string"}


def test_what_vllm_serve_refuses_mmserve_refuses(vllm_app, vllm_serve_reference):
    """Every `tools` entry of the corpus: a 400 from both but those typed more strictly here (mmserve's
    error shape and param are checked entry by entry in tests/bad_requests), and the engine serves
    afterwards."""
    differ = []
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as client:
        for case in TOOL_CASES:
            ours = client.post(vllm_app.app.base_url + case.endpoint, content=case.content(), headers=headers)
            theirs = client.post(vllm_serve_reference.base_url + case.endpoint, content=case.content(), headers=headers)
            if (ours.status_code, theirs.status_code) != (400, 200 if case.id in STRICTER_THAN_VLLM else 400):
                differ.append((case.id, ours.status_code, theirs.status_code, theirs.text[:200]))
    assert not differ, differ
    assert vllm_app.engine.is_alive()
    messages, fields = CASES["tools-none"]
    assert _chat(vllm_app, messages, **GREEDY, **fields).choices[0].finish_reason in ("stop", "length")
