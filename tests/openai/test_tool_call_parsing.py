"""Tool calls with a tool-call parser (`hermes`), against vLLM 0.32's own parser (reference venv):

- what a request asks of the engine: `skip_special_tokens` and the structural tag, byte for byte the JSON
  text vLLM's `adjust_request` puts in `structured_outputs` (or the request's own structured outputs
  where vLLM keeps them), for every tool choice, `strict`, `parallel_tool_calls` and constraint;
- whole answers: the content and calls vLLM's `Parser.parse` reads, on a corpus of model outputs
  (calls, text around them, several calls, truncated and malformed ones);
- streams: the deltas vLLM's `Parser.parse_delta` returns for the same outputs cut into pieces of every
  size, tool-call ids aside (random in both).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import msgspec
import pytest

from mmserve.openai.errors import OpenAIError
from mmserve.openai.protocol import ChatCompletionRequest
from mmserve.openai.settings import ToolCallSettings
from mmserve.openai.structured_outputs import structured_outputs
from mmserve.openai.choice_output import ChoiceOutput
from mmserve.openai.output_parsing import output_parsing
from mmserve.openai.tool_calls import check_tools, engine_tool_constraints, tool_call_plan
from tests.support.deltas import without_tool_call_ids as _without_ids

MODEL_DIR = Path(__file__).resolve().parents[2] / "mmserve" / "builtin_engine" / "model"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
    },
}  # fmt: skip
NO_ARGS = {"type": "function", "function": {"name": "ping"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}

STRICTNESS = {"unset": None, "strict": True, "not-strict": False}
CHOICES = {"default": ..., "auto": "auto", "required": "required", "named": NAMED, "none": "none", "null": None}
PARALLEL = {"unset": ..., "parallel": True, "single": False}
CONSTRAINTS = {
    "none": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}}},
    "regex": {"structured_outputs": {"regex": "[a-z]{3}"}},
    "choice": {"structured_outputs": {"choice": ["yes", "no"]}},
    "ebnf": {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
}  # fmt: skip

OUTPUTS = [
    "Just text, no call.",
    "",
    "   ",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}</tool_call>',
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"',  # truncated by max_tokens
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}',  # complete JSON, no end tag
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_',
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',  # name not a string
    '<tool_call>["a list"]</tool_call>',
    "<tool_call></tool_call>",
    'text <tool_ and more <tool_call>{"name": "ping", "arguments": {"deep": {"a": [1, 2, {"b": null}]}}}</tool_call> after',
    "a < b and <tool is not a call",
    ' \n<tool_call>{"name": "ping", "arguments": {}}</tool_call>',  # whitespace before the call
]
PIECES = [1, 2, 3, 7, 1000]


def _body(tools=None, choice=..., parallel=..., constraint="none") -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], **copy.deepcopy(CONSTRAINTS[constraint])}
    if tools is not None:
        body["tools"] = tools
    if choice is not ...:
        body["tool_choice"] = choice
    if parallel is not ...:
        body["parallel_tool_calls"] = parallel
    return body


def _tools(strictness: str) -> list[dict]:
    tools = copy.deepcopy([WEATHER, NO_ARGS])
    if STRICTNESS[strictness] is not None:
        for tool in tools:
            tool["function"]["strict"] = STRICTNESS[strictness]
    return tools


@pytest.fixture(scope="module")
def vllm_parser():
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest
    from vllm.parser.parser_manager import ParserManager

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    parser_class = ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True)

    def make(body: dict):
        request = VllmRequest.model_validate(body)
        return parser_class(tokenizer, request.tools), request

    return make


def _ours(body: dict, enable_auto: bool = True):
    config = ToolCallSettings(parser="hermes", enable_auto_tool_choice=enable_auto)
    request = ChatCompletionRequest.model_validate(body)
    plan = tool_call_plan(request, check_tools(request, config), config)
    assert plan is not None
    return request, plan


@pytest.mark.parametrize("constraint", CONSTRAINTS)
@pytest.mark.parametrize("parallel", PARALLEL)
@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("strictness", STRICTNESS)
def test_engine_constraints_equal_vllm_adjust_request(vllm_parser, strictness, choice, parallel, constraint):
    body = _body(_tools(strictness), CHOICES[choice], PARALLEL[parallel], constraint)
    try:
        parser, vllm_request = vllm_parser(body)
    except Exception as refused:  # noqa: BLE001 - vLLM's request model refuses the combination: so does mmserve
        with pytest.raises(OpenAIError) as ours:
            _ours(body)
        assert ours.value.status == 400 and ours.value.message in str(refused)
        return
    adjusted = parser.adjust_request(vllm_request) if vllm_request.tool_choice != "none" else vllm_request
    request, plan = _ours(body)
    own = structured_outputs(request)
    changed = engine_tool_constraints(request, plan, own)
    skip, sent = (request.skip_special_tokens, own) if changed is None else changed
    assert skip == adjusted.skip_special_tokens
    vllm_tag = adjusted.structured_outputs.structural_tag if adjusted.structured_outputs is not None else None
    assert (sent.structural_tag if sent is not None else None) == vllm_tag
    if vllm_tag is None:  # vLLM keeps the request's own constraint (compared with vLLM's elsewhere): so does mmserve
        assert sent is own


# Without auto tool choice, "auto" is refused before any answer (test_tool_calls.py).
WHOLE_CHOICES = [(c, True) for c in ("auto", "required", "named", "none", "null")] + [(c, False) for c in ("required", "named", "none", "null")]


@pytest.mark.parametrize(("choice", "enable_auto"), WHOLE_CHOICES, ids=[f"{c}-{'auto' if a else 'no-auto'}" for c, a in WHOLE_CHOICES])
@pytest.mark.parametrize("output", range(len(OUTPUTS)))
def test_whole_answers_equal_vllm_parse(vllm_parser, output, choice, enable_auto):
    text = OUTPUTS[output]
    body = _body(_tools("unset"), CHOICES[choice])
    parser, vllm_request = vllm_parser(body)
    _, vllm_content, vllm_calls = parser.parse(text, vllm_request, enable_auto_tools=enable_auto)
    _, plan = _ours(body, enable_auto)
    calls, content = _reader(plan).tool_calls_of(text)
    assert content == vllm_content
    if vllm_calls is None:
        assert calls is None
    else:
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in vllm_calls]
        assert all(c.id.startswith("chatcmpl-tool-") for c in calls)


def _vllm_delta(message) -> dict | None:
    """The `delta` of vLLM's chunk, as its JSON shows it (`model_dump_json(exclude_unset=True)`)."""
    return None if message is None else _without_ids(json.loads(message.model_dump_json(exclude_unset=True)))


def _our_delta(message) -> dict | None:
    return None if message is None else _without_ids(msgspec.json.decode(msgspec.json.encode(message)))


def _reader(plan) -> ChoiceOutput:
    """One choice's reader with the tool-call parser alone (no reasoning parser)."""
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    parsing = output_parsing(request, plan, None, [1])
    assert parsing is not None
    return ChoiceOutput(parsing)


@pytest.mark.parametrize("single", [False, True], ids=["parallel", "single"])
@pytest.mark.parametrize("choice", ["auto", "required", "named", "none", "null"])
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("output", range(len(OUTPUTS)))
def test_streamed_deltas_equal_vllm_parse_delta(vllm_parser, output, piece, choice, single):
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

    text = OUTPUTS[output]
    body = _body(_tools("unset"), CHOICES[choice], False if single else ...)
    parser, vllm_request = vllm_parser(body)
    _, plan = _ours(body)
    ours = _reader(plan)
    cuts = [text[i : i + piece] for i in range(0, len(text), piece)] or [""]
    for i, delta_text in enumerate(cuts):
        finished = i == len(cuts) - 1
        theirs = parser.parse_delta(delta_text, [], vllm_request, prompt_token_ids=[1], finished=finished)
        if theirs is not None:
            theirs = maybe_filter_parallel_tool_calls(theirs, vllm_request)
        assert _our_delta(ours.delta(delta_text, [], finished)) == _vllm_delta(theirs), (i, delta_text)
