"""Reasoning with a reasoning parser (`deepseek_r1`; `qwen3`, thinking and not), alone and before the
`hermes` tool-call parser, against vLLM 0.32's own parsers composed as its server composes them
(`ParserManager.get_parser`, reference venv), on the built-in model's tokenizer with `<think>` and
`</think>` added as tokens (for `qwen3` also with `<tool_call>` and `</tool_call>` as tokens, as Qwen3 has
them, which its grammar then recognises by id):

- the tags' ids in mmserve's tokenizer equal Hugging Face's, and texts tokenize alike;
- whole answers: the reasoning, content and calls vLLM's `Parser.parse` reads, and the reasoning tokens
  its `count_reasoning_tokens` counts (usage's `completion_tokens_details`);
- streams: the deltas vLLM's `Parser.parse_delta` returns (JSON as on the wire, tool-call ids aside), and
  the reasoning tokens counted after them, for the same answers cut into pieces of 1, 2, 3, 7 and 1000
  tokens (text of an incomplete character held back as vLLM's detokenizer holds it), after prompts that
  leave the reasoning open, close it, or have no tags, with `include_reasoning` true and false;
- what goes to the engine: `EngineCoreRequest.reasoning_ended`, as vLLM's `resolve_reasoning_ended`, and
  the chat template kwargs the parsers are built with (`reasoning_parser_kwargs`).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from mmserve.model_files import ModelFiles
from mmserve.openai.choice_output import ChoiceOutput
from mmserve.openai.output_parsing import output_parsing, reasoning_ended, reasoning_setup, template_kwargs
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
    "<think>Reasoning mentions <tool_call> in passing.</think>No call.",
    # What the qwen3 grammar reads differently: `<` and `>` held back, its tool markup, special tokens
    # (dropped by it), whitespace-only content, characters cut across tokens.
    "A < b and c > d, <b>bold</b>, <thi and </thin.</think>Content <with> <tool_ and </think> again.",
    f"Thinking of <function=get_weather> and <parameter=city> here.</think>{CALL}",
    "Reasoning<|im_end|>more<|endoftext|></think>after<|im_start|>x",
    "<think>x</think>\n\n  \n",
    "  \n</think>  \n  Answer  \n",
    "Ünïcödé 😀 and 漢字 reasoning</think>😀 content 漢字",
    "<tool_call>Straight into a call without a closing think.</tool_call> tail",
    "推理漢字😀</think>😀內容<|im_end|>😀",
    "Cut off mid-tag: </thi",
    # Tags spelled by ordinary tokens (each piece tokenized alone): text, not tags, once a stream has ids.
    ("Spelled ", "</", "think", ">", " still reasoning <", "tool_call", "> then</think>Content ", "<", "think", "> end"),
]
PIECES = [1, 2, 3, 7, 1000]
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
# parser, its tokenizer ("think": <think> and </think> as tokens; "think+tools": <tool_call> and
# </tool_call> too), and the request's chat_template_kwargs
CASES = {
    "deepseek_r1": ("deepseek_r1", "think", None),
    "qwen3": ("qwen3", "think", None),
    "qwen3-tool-tokens": ("qwen3", "think+tools", None),
    "qwen3-no-thinking": ("qwen3", "think+tools", {"enable_thinking": False}),
}
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
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {
        "think": write_think_tokenizer_files(tmp_path_factory.mktemp("think-tokenizer")),
        "think+tools": write_think_tokenizer_files(tmp_path_factory.mktemp("think-tools-tokenizer"), TOOL_TOKENS),
    }


@pytest.fixture(scope="module")
def hf_tokenizers(model_dirs):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(path) for name, path in model_dirs.items()}


@pytest.fixture(scope="module")
def our_setups(model_dirs):
    setups = {}
    for case, (parser, tokenizer, _) in CASES.items():
        setups[case] = reasoning_setup(parser, Tokenizer.from_model_files(ModelFiles.load(model_dirs[tokenizer])))
    return setups


def _body(setup: str, include_reasoning: bool = True, case: str = "deepseek_r1") -> dict:
    _, choice = SETUPS[setup]
    body: dict = {"model": "m", "messages": [{"role": "user", "content": "weather?"}]}
    if choice is not None:
        body.update(tools=[WEATHER], tool_choice=choice)
    if not include_reasoning:
        body["include_reasoning"] = False
    if CASES[case][2] is not None:
        body["chat_template_kwargs"] = CASES[case][2]
    return body


def _vllm(setup: str, body: dict, hf_tokenizer, case: str = "deepseek_r1"):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest
    from vllm.parser.parser_manager import ParserManager

    tool_parser, _ = SETUPS[setup]
    parser_class = ParserManager.get_parser(tool_parser_name=tool_parser, reasoning_parser_name=CASES[case][0], enable_auto_tools=True)
    request = VllmRequest.model_validate(body)
    kwargs = request.build_chat_params(None, "auto").chat_template_kwargs  # as vLLM's chat serving builds it
    return parser_class(hf_tokenizer, request.tools, chat_template_kwargs=kwargs), request


def _ours(setup: str, body: dict, reasoning, prompt_ids: list[int]) -> ChoiceOutput:
    tool_parser, _ = SETUPS[setup]
    request = ChatCompletionRequest.model_validate(body)
    config = ToolCallSettings(parser=tool_parser, enable_auto_tool_choice=tool_parser is not None)
    parsing = output_parsing(request, tool_call_plan(request, check_tools(request, config), config), reasoning, prompt_ids)
    assert parsing is not None
    return ChoiceOutput(parsing)


def _encoded(output: str | tuple[str, ...], hf_tokenizer) -> tuple[str, list[int]]:
    """An output's text and token ids (a tuple: its pieces tokenized one by one)."""
    pieces = (output,) if isinstance(output, str) else output
    return "".join(pieces), [i for piece in pieces for i in hf_tokenizer.encode(piece, add_special_tokens=False)]


def _stream_deltas(hf_tokenizer, ids: list[int], piece: int) -> list[tuple[str, list[int], bool]]:
    """(text, token ids, finished) per piece of `piece` tokens, the text as vLLM's detokenizer gives it:
    an incomplete character at the end is held back until a later piece completes it (that piece's text
    then starts with it). With an odd `piece` the stream ends on the end-of-sequence token, alone in the
    last delta and without its text, as an engine's stream that stops on it ends."""
    eos = piece % 2 == 1
    # With pieces of 3, the request also has a stop string of 9 characters that never matches: the
    # detokenizer then holds back the last 8 characters of the text until the stream ends (vLLM's
    # `stop_buffer_length`), so deltas come with ids and no text, and terminals' texts come later.
    stop_buffer = 8 if piece == 3 else 0
    cuts = list(range(0, len(ids), piece)) or [0]
    deltas, shown = [], ""
    for i, start in enumerate(cuts):
        stop = cuts[i + 1] if i + 1 < len(cuts) else len(ids)
        text = hf_tokenizer.decode(ids[:stop])
        finished = i == len(cuts) - 1 and not eos
        if not finished:
            text = text.rstrip("\ufffd")
            text = text[: max(len(shown), len(text) - stop_buffer)]
        deltas.append((text[len(shown) :], ids[start:stop], finished))
        shown = text
    if eos:
        rest = hf_tokenizer.decode(ids)[len(shown) :]  # what the stop buffer still held
        deltas.append((rest, [hf_tokenizer.convert_tokens_to_ids("<|im_end|>")], True))
    return deltas


def test_think_tokens_and_texts_tokenize_as_hugging_face(model_dirs, hf_tokenizers, our_setups):
    deepseek = our_setups["deepseek_r1"]
    assert (deepseek.start_token_id, deepseek.end_token_id) == tuple(hf_tokenizers["think"].convert_tokens_to_ids(list(THINK_TOKENS)))
    for name, model_dir in model_dirs.items():
        ours, theirs = Tokenizer.from_model_files(ModelFiles.load(model_dir)), hf_tokenizers[name]
        assert (ours.all_special_tokens, ours.all_special_ids) == (tuple(theirs.all_special_tokens), tuple(theirs.all_special_ids))
        for token in THINK_TOKENS + (TOOL_TOKENS if name == "think+tools" else ()):
            assert ours.token_to_id(token) == theirs.convert_tokens_to_ids(token) is not None
        for text in [o for o in OUTPUTS if isinstance(o, str)] + list(PROMPTS.values()):
            assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        eos = theirs.convert_tokens_to_ids("<|im_end|>")
        assert [ours.decode([i], skip_special_tokens=False) for i in (eos, *ours.all_special_ids)] == [theirs.decode([i]) for i in (eos, *theirs.all_special_ids)]


def test_a_tokenizer_without_the_tags_is_refused_at_start_by_deepseek_r1_not_qwen3():
    tokenizer = Tokenizer.from_model_files(ModelFiles.load(MODEL_DIR))
    with pytest.raises(ValueError, match="<think> and </think> as tokens"):
        reasoning_setup("deepseek_r1", tokenizer)
    qwen3 = reasoning_setup("qwen3", tokenizer)  # vLLM's qwen3 starts too, reading the tags as text
    assert qwen3 is not None and qwen3.parser().extract_reasoning("a</think>b") == ("a", "b")


def _hf(case: str, hf_tokenizers):
    return hf_tokenizers[CASES[case][1]]


@pytest.mark.parametrize("include_reasoning", [True, False], ids=["shown", "hidden"])
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("output", range(len(OUTPUTS)))
@pytest.mark.parametrize("case", CASES)
def test_whole_answers_equal_vllm_parse(hf_tokenizers, our_setups, case, output, setup, include_reasoning):
    hf_tokenizer = _hf(case, hf_tokenizers)
    text, ids = _encoded(OUTPUTS[output], hf_tokenizer)
    body = _body(setup, include_reasoning, case)
    parser, vllm_request = _vllm(setup, body, hf_tokenizer, case)
    reasoning, content, calls = parser.parse(text, vllm_request, enable_auto_tools=True, model_output_token_ids=ids)
    if not include_reasoning:
        reasoning = None  # vLLM's chat serving drops it after parsing
    ours = _ours(setup, body, our_setups[case], [1])
    answer = ours.whole(text, "stop")
    named_or_required = isinstance(SETUPS[setup][1], dict) or SETUPS[setup][1] == "required"
    assert (answer.reasoning, answer.content) == (reasoning, content or "" if named_or_required else content)
    our_calls = [(c.name, c.arguments) for c in answer.tool_calls or []]
    assert our_calls == [(c.name, c.arguments) for c in calls or []]
    assert ours.reasoning_tokens(ids) == parser.count_reasoning_tokens(ids)


# Every case with the reasoning alone and with `auto` tool calls; the other tool choices with one parser
# of each kind (their tool phase is the same code whichever parser ended the reasoning).
STREAM_RUNS = [
    (case, setup)
    for case in CASES
    for setup in SETUPS
    if setup in ("reasoning-only", "hermes-auto") or case in ("deepseek_r1", "qwen3-tool-tokens")
]


@pytest.mark.parametrize("include_reasoning", [True, False], ids=["shown", "hidden"])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("output", range(len(OUTPUTS)))
@pytest.mark.parametrize(("case", "setup"), STREAM_RUNS)
def test_streamed_deltas_equal_vllm_parse_delta(hf_tokenizers, our_setups, case, setup, output, prompt, include_reasoning):
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

    hf_tokenizer = _hf(case, hf_tokenizers)
    _, ids = _encoded(OUTPUTS[output], hf_tokenizer)
    body = _body(setup, include_reasoning, case)
    prompt_ids = hf_tokenizer.encode("<|im_start|>user\nweather?<|im_end|>\n" + PROMPTS[prompt], add_special_tokens=False)
    for piece in PIECES:
        parser, vllm_request = _vllm(setup, body, hf_tokenizer, case)
        ours = _ours(setup, body, our_setups[case], prompt_ids)
        deltas = _stream_deltas(hf_tokenizer, ids, piece)
        for i, (delta_text, delta_ids, finished) in enumerate(deltas):
            theirs = parser.parse_delta(delta_text, delta_ids, vllm_request, prompt_token_ids=prompt_ids, finished=finished)
            if theirs is not None:
                theirs = maybe_filter_parallel_tool_calls(theirs, vllm_request)
            mine = ours.delta(delta_text, delta_ids, finished)
            expected = None if theirs is None else _without_ids(json.loads(theirs.model_dump_json(exclude_unset=True)))
            shown = None if mine is None else _without_ids(msgspec.json.decode(msgspec.json.encode(mine)))
            assert shown == expected, (piece, i, delta_text)
        generated = [i for _, delta_ids, _ in deltas for i in delta_ids]
        assert ours.reasoning_tokens(generated) == parser.count_reasoning_tokens(tuple(generated)), piece


@pytest.mark.parametrize("include_reasoning", [True, False], ids=["shown", "hidden"])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("case", CASES)
def test_reasoning_ended_equals_vllm(hf_tokenizers, our_setups, case, prompt, include_reasoning):
    hf_tokenizer = _hf(case, hf_tokenizers)
    body = _body("reasoning-only", include_reasoning, case)
    parser, vllm_request = _vllm("reasoning-only", body, hf_tokenizer, case)
    for prompt_text in (PROMPTS[prompt], "<|im_start|>user\n<think>a</think><tool_call><|im_end|>\n" + PROMPTS[prompt]):
        prompt_ids = hf_tokenizer.encode(prompt_text, add_special_tokens=False)
        request = ChatCompletionRequest.model_validate(body)
        with_parser = output_parsing(request, None, our_setups[case], prompt_ids)
        assert reasoning_ended(request, with_parser) == vllm_request.resolve_reasoning_ended(parser, prompt_ids)
        assert reasoning_ended(request, None) == vllm_request.resolve_reasoning_ended(None, prompt_ids)


@pytest.mark.parametrize(
    "fields",
    [{}, {"reasoning_effort": "none"}, {"reasoning_effort": "high"}, {"chat_template_kwargs": {"enable_thinking": False}},
     {"chat_template_kwargs": {"enable_thinking": True, "x": 1}, "reasoning_effort": "none"},
     {"chat_template_kwargs": {"enable_thinking": None}}, {"add_generation_prompt": False, "continue_final_message": True}],
)  # fmt: skip
def test_the_parsers_template_kwargs_equal_vllms(fields):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    expected = VllmRequest.model_validate(body).build_chat_params(None, "auto").chat_template_kwargs
    assert template_kwargs(ChatCompletionRequest.model_validate(body)) == expected
