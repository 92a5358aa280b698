"""Reasoning with a reasoning parser (`deepseek_r1`), alone and before the `hermes` tool-call parser,
against vLLM 0.32's own parsers composed as its server composes them (`ParserManager.get_parser`,
reference venv), on the built-in model's tokenizer with `<think>` and `</think>` added as tokens:

- the tags' ids in mmserve's tokenizer equal Hugging Face's, and texts tokenize alike;
- whole answers: the reasoning, content and calls vLLM's `Parser.parse` reads, and the reasoning tokens
  its `count_reasoning_tokens` counts (usage's `completion_tokens_details`);
- streams: the deltas vLLM's `Parser.parse_delta` returns (JSON as on the wire, tool-call ids aside) for
  the same answers cut into pieces of 1, 2, 3, 7 and 1000 tokens, after prompts that leave the reasoning
  open, close it, or have no tags, with `include_reasoning` true and false;
- what goes to the engine: `EngineCoreRequest.reasoning_ended`, as vLLM's `resolve_reasoning_ended`.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from mmserve.model_files import ModelFiles
from mmserve.openai.choice_output import ChoiceOutput
from mmserve.openai.output_parsing import output_parsing, reasoning_ended, reasoning_setup
from mmserve.openai.protocol import ChatCompletionRequest
from mmserve.openai.settings import ToolCallSettings
from mmserve.openai.tool_calls import check_tools, tool_call_plan
from mmserve.text import Tokenizer
from tests.support.deltas import without_tool_call_ids as _without_ids
from tests.support.tiny_models import THINK_TOKENS, write_think_tokenizer_files

MODEL_DIR = Path(__file__).resolve().parents[2] / "mmserve" / "builtin_engine" / "model"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
OUTPUTS = [
    "A plain answer.",
    "",
    "<think>Let me think.</think>The answer is 4.",
    "<think>\nStep one.\nStep two.\n</think>\n\nFour.",
    "The template opened it: reasoning here.</think>Then the answer.",
    "<think>Never closed, cut by max_tokens",
    "Reasoning with no tags at all, the prompt opened them",
    "<think></think>",
    "</think>",
    "<think>Only reasoning.</think>",
    "Before <think>inside</think> after",
    "<think>a</think>b</think>c",
    f"<think>I should call a tool.</think>{CALL}",
    f"<think>Calling.</think>Let me look.\n{CALL}",
    f"Opened by the template.</think>\n{CALL}",
    f"<think>Reasoning mentions <tool_call> in passing.</think>No call.",
]
PIECES = [1, 2, 3, 7, 1000]
PROMPTS = {  # the end of the chat template's generation prompt
    "opens": "<|im_start|>assistant\n<think>\n",
    "closes": "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "no-tags": "<|im_start|>assistant\n",
}
SETUPS = {  # tool-call parser, tool_choice (None: no tools in the request)
    "reasoning-only": (None, None),
    "hermes-auto": ("hermes", "auto"),
    "hermes-none": ("hermes", "none"),
    "hermes-required": ("hermes", "required"),
    "hermes-named": ("hermes", {"type": "function", "function": {"name": "get_weather"}}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_think_tokenizer_files(tmp_path_factory.mktemp("think-tokenizer"))


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def our_reasoning(model_dir):
    return reasoning_setup("deepseek_r1", Tokenizer.from_model_files(ModelFiles.load(model_dir)))


def _body(setup: str, include_reasoning: bool = True) -> dict:
    _, choice = SETUPS[setup]
    body: dict = {"model": "m", "messages": [{"role": "user", "content": "weather?"}]}
    if choice is not None:
        body.update(tools=[WEATHER], tool_choice=choice)
    if not include_reasoning:
        body["include_reasoning"] = False
    return body


def _vllm(setup: str, body: dict, hf_tokenizer):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest
    from vllm.parser.parser_manager import ParserManager

    tool_parser, _ = SETUPS[setup]
    parser_class = ParserManager.get_parser(tool_parser_name=tool_parser, reasoning_parser_name="deepseek_r1", enable_auto_tools=True)
    request = VllmRequest.model_validate(body)
    return parser_class(hf_tokenizer, request.tools), request


def _ours(setup: str, body: dict, reasoning, prompt_ids: list[int]) -> ChoiceOutput:
    tool_parser, _ = SETUPS[setup]
    request = ChatCompletionRequest.model_validate(body)
    config = ToolCallSettings(parser=tool_parser, enable_auto_tool_choice=tool_parser is not None)
    parsing = output_parsing(request, tool_call_plan(request, check_tools(request, config), config), reasoning, prompt_ids)
    assert parsing is not None
    return ChoiceOutput(parsing)


def test_think_tokens_and_texts_tokenize_as_hugging_face(model_dir, hf_tokenizer, our_reasoning):
    ours = Tokenizer.from_model_files(ModelFiles.load(model_dir))
    assert (our_reasoning.start_token_id, our_reasoning.end_token_id) == tuple(hf_tokenizer.convert_tokens_to_ids(list(THINK_TOKENS)))
    for text in OUTPUTS + list(PROMPTS.values()):
        assert ours.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False), text


def test_a_tokenizer_without_the_tags_is_refused_at_start():
    with pytest.raises(ValueError, match="<think> and </think> as tokens"):
        reasoning_setup("deepseek_r1", Tokenizer.from_model_files(ModelFiles.load(MODEL_DIR)))


@pytest.mark.parametrize("include_reasoning", [True, False], ids=["shown", "hidden"])
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("output", range(len(OUTPUTS)))
def test_whole_answers_equal_vllm_parse(hf_tokenizer, our_reasoning, output, setup, include_reasoning):
    text = OUTPUTS[output]
    body = _body(setup, include_reasoning)
    parser, vllm_request = _vllm(setup, body, hf_tokenizer)
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    reasoning, content, calls = parser.parse(text, vllm_request, enable_auto_tools=True, model_output_token_ids=ids)
    if not include_reasoning:
        reasoning = None  # vLLM's chat serving drops it after parsing
    ours = _ours(setup, body, our_reasoning, [1])
    answer = ours.whole(text, "stop")
    named_or_required = isinstance(SETUPS[setup][1], dict) or SETUPS[setup][1] == "required"
    assert (answer.reasoning, answer.content) == (reasoning, content or "" if named_or_required else content)
    our_calls = [(c.name, c.arguments) for c in answer.tool_calls or []]
    assert our_calls == [(c.name, c.arguments) for c in calls or []]
    assert ours.reasoning_tokens(ids) == parser.count_reasoning_tokens(ids)


@pytest.mark.parametrize("include_reasoning", [True, False], ids=["shown", "hidden"])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("output", range(len(OUTPUTS)))
def test_streamed_deltas_equal_vllm_parse_delta(hf_tokenizer, our_reasoning, output, piece, setup, prompt, include_reasoning):
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

    text = OUTPUTS[output]
    body = _body(setup, include_reasoning)
    parser, vllm_request = _vllm(setup, body, hf_tokenizer)
    prompt_ids = hf_tokenizer.encode("<|im_start|>user\nweather?<|im_end|>\n" + PROMPTS[prompt], add_special_tokens=False)
    ours = _ours(setup, body, our_reasoning, prompt_ids)
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    cuts = list(range(0, len(ids), piece)) or [0]
    for i, start in enumerate(cuts):
        stop = cuts[i + 1] if i + 1 < len(cuts) else len(ids)
        delta_ids = ids[start:stop]
        delta_text = hf_tokenizer.decode(ids[:stop])[len(hf_tokenizer.decode(ids[:start])) :]
        finished = i == len(cuts) - 1
        theirs = parser.parse_delta(delta_text, delta_ids, vllm_request, prompt_token_ids=prompt_ids, finished=finished)
        if theirs is not None:
            theirs = maybe_filter_parallel_tool_calls(theirs, vllm_request)
        mine = ours.delta(delta_text, delta_ids, finished)
        expected = None if theirs is None else _without_ids(json.loads(theirs.model_dump_json(exclude_unset=True)))
        assert (None if mine is None else _without_ids(msgspec.json.decode(msgspec.json.encode(mine)))) == expected, (i, delta_text)


@pytest.mark.parametrize("include_reasoning", [True, False], ids=["shown", "hidden"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_reasoning_ended_equals_vllm(hf_tokenizer, our_reasoning, prompt, include_reasoning):
    body = _body("reasoning-only", include_reasoning)
    parser, vllm_request = _vllm("reasoning-only", body, hf_tokenizer)
    prompt_ids = hf_tokenizer.encode(PROMPTS[prompt], add_special_tokens=False)
    request = ChatCompletionRequest.model_validate(body)
    with_parser = output_parsing(request, None, our_reasoning, prompt_ids)
    assert reasoning_ended(request, with_parser) == vllm_request.resolve_reasoning_ended(parser, prompt_ids)
    assert reasoning_ended(request, None) == vllm_request.resolve_reasoning_ended(None, prompt_ids)
