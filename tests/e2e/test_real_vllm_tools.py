"""Tools against `vllm serve --enable-auto-tool-choice --tool-call-parser hermes` (started in this run on
the same tiny Qwen2-VL, whose chat template renders tools: tests/support/tiny_models.py), the session app
configured alike:

- with `tool_choice` "none" or null, requests carrying tools and a tool-call history (assistant
  `tool_calls`, `tool` messages) get the same prompt token ids, tokens, text and finish reasons;
- every tool choice (`auto`, by default or with a strict tool, `required`, a named function, null),
  `parallel_tool_calls: false`, strict and free arguments, a tool history, `auto` with `response_format`:
  the same tokens (the engine got the same structural tag), content, calls (names and arguments; ids are
  random in both) and finish reasons, streamed and not;
- what `vllm serve` refuses, mmserve refuses too (every `tools` entry of the bad-request corpus is a 400
  from both, but those a server with a parser serves), with the engine still serving afterwards.

What a server without a parser refuses is checked against vLLM's own messages in tests/openai/test_tool_calls.py
and on the built-in app by the bad-request corpus.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.bad_requests.corpus import CORPUS, SERVED_WITH_A_TOOL_CALL_PARSER
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


# Strict tools whose arguments the structural tag pins to one short JSON value with no room for whitespace,
# so that the tiny random model finishes its calls (in an object it writes whitespace for ever), and tools
# whose arguments are any JSON (truncated calls: the answer is content, in both).
WEATHER_STRICT = {
    "type": "function",
    "function": {"name": "get_weather", "strict": True, "parameters": {"type": "string", "enum": ["Paris", "Tokyo"]}},
}
CLOCK_STRICT = {"type": "function", "function": {"name": "now", "strict": True, "parameters": {"enum": ["utc"]}}}
WEATHER_OBJECT_STRICT = {
    "type": "function",
    "function": {
        "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                       "required": ["city"], "additionalProperties": False},
    },
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHOICE_CASES = {
    "auto-default": (ASK, {"tools": [WEATHER, CLOCK]}),
    "auto-strict": (ASK, {"tools": [WEATHER_STRICT, CLOCK], "tool_choice": "auto"}),
    "auto-single": (ASK, {"tools": [WEATHER, CLOCK], "parallel_tool_calls": False}),
    "auto-json-object": (ASK, {"tools": [WEATHER_STRICT], "response_format": {"type": "json_object"}}),
    "required": (ASK, {"tools": [WEATHER_STRICT, CLOCK_STRICT], "tool_choice": "required"}),
    "required-single": (ASK, {"tools": [WEATHER_STRICT, CLOCK_STRICT], "tool_choice": "required", "parallel_tool_calls": False}),
    "required-free-arguments": (ASK, {"tools": [WEATHER, CLOCK], "tool_choice": "required"}),
    "named": (ASK, {"tools": [WEATHER_STRICT, CLOCK], "tool_choice": NAMED}),
    "named-object": (ASK, {"tools": [WEATHER_OBJECT_STRICT], "tool_choice": NAMED}),
    "named-free-arguments": (ASK, {"tools": [WEATHER], "tool_choice": NAMED}),
    "null": (ASK, {"tools": [WEATHER], "tool_choice": None}),
    "history-required": (HISTORY, {"tools": [WEATHER_STRICT], "tool_choice": "required", "parallel_tool_calls": False}),
}
CHOICE_SAMPLING = {"temperature": 0.0, "max_tokens": 80, "return_token_ids": True}  # one character a token: a call is 64


def _answer(base_url: str, messages: list, fields: dict) -> dict:
    """The parts of a non-streamed answer that must be equal."""
    body = {"model": "tiny-qwen2-vl", "messages": messages, **CHOICE_SAMPLING, **fields}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    assert all(call["id"].startswith("chatcmpl-tool-") and call["type"] == "function" for call in calls), calls
    return {
        "token_ids": choice["token_ids"], "content": choice["message"]["content"], "finish_reason": choice["finish_reason"],
        "tool_calls": [(call["function"]["name"], call["function"]["arguments"]) for call in calls],
    }  # fmt: skip


def _streamed(base_url: str, messages: list, fields: dict) -> dict:
    """A streamed answer put together: content, calls by index (the id and name in a call's first delta,
    its arguments in pieces), token ids, finish reason."""
    body = {"model": "tiny-qwen2-vl", "messages": messages, "stream": True, **CHOICE_SAMPLING, **fields}
    content, calls, ids, finish = None, {}, [], None
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                delta = choice["delta"]
                if delta.get("content") is not None:
                    content = (content or "") + delta["content"]
                for call in delta.get("tool_calls", ()):
                    if call["index"] not in calls:
                        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function", call
                        calls[call["index"]] = [call["function"]["name"], ""]
                    calls[call["index"]][1] += call["function"].get("arguments") or ""
                ids += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
    return {"token_ids": ids, "content": content, "finish_reason": finish, "tool_calls": [tuple(calls[i]) for i in sorted(calls)]}


def _comparable(answer: dict, stream: bool) -> dict:
    """A streamed answer cut by max_tokens inside a call: that call's arguments depend on how the tokens
    were batched into chunks, in vLLM as here (its parser adds "{}" for a call cut before its arguments
    when the call's name arrives in the last chunk, not before), so they are left out."""
    if stream and answer["finish_reason"] == "length" and answer["tool_calls"]:
        *complete, (name, _) = answer["tool_calls"]
        answer = {**answer, "tool_calls": [*complete, (name, "(cut)")]}
    return answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_tool_choice_answers_as_vllm_serve(vllm_app, vllm_serve_reference, stream):
    answer = _streamed if stream else _answer
    theirs = {name: _comparable(answer(vllm_serve_reference.base_url, *case), stream) for name, case in CHOICE_CASES.items()}
    ours = {name: _comparable(answer(vllm_app.app.base_url, *case), stream) for name, case in CHOICE_CASES.items()}
    assert ours == theirs
    # Not vacuous: calls were made, and read, where the engine was made to write them.
    for name in ("required-single", "named", "history-required"):
        assert theirs[name]["tool_calls"], (name, theirs[name])
    assert theirs["required-single"]["finish_reason"] == "tool_calls"


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
    error shape and param are checked entry by entry in tests/bad_requests) and those a server with a
    tool-call parser serves (a 200 from both), and the engine serves afterwards."""
    differ = []
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as client:
        for case in TOOL_CASES:
            ours = client.post(vllm_app.app.base_url + case.endpoint, content=case.content(), headers=headers)
            theirs = client.post(vllm_serve_reference.base_url + case.endpoint, content=case.content(), headers=headers)
            expected = (400, 200) if case.id in STRICTER_THAN_VLLM else (400, 400)
            if case.id in SERVED_WITH_A_TOOL_CALL_PARSER:
                expected = (200, 200)
            if (ours.status_code, theirs.status_code) != expected:
                differ.append((case.id, ours.status_code, theirs.status_code, theirs.text[:200]))
    assert not differ, differ
    assert vllm_app.engine.is_alive()
    messages, fields = CASES["tools-none"]
    assert _chat(vllm_app, messages, **GREEDY, **fields).choices[0].finish_reason in ("stop", "length")
