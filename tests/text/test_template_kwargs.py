"""`chat_template_kwargs` and `reasoning_effort` reach the chat template as vLLM 0.32 hands them to it
(reference venv): the request's kwargs, then its own `reasoning_effort` where given, `enable_thinking`
from it unless the kwargs set it, `add_generation_prompt` always the request's, and only what the
template declares. Compared with vLLM's `build_chat_params` + `safe_apply_chat_template` on a template
with Qwen3's thinking switch; and the kwargs vLLM refuses are refused in its words.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mmserve.openai.errors import OpenAIError
from mmserve.openai.protocol import ChatCompletionRequest
from mmserve.openai.request_checks import check_chat_request
from mmserve.openai.settings import ToolCallSettings
from mmserve.text import ChatTemplate, ConversationMessage

MODEL_DIR = Path(__file__).resolve().parents[2] / "mmserve" / "builtin_engine" / "model"
# Qwen3's switch (its template closes an empty think block when thinking is off), plus two variables.
TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{%- endif %}"
    "{%- if custom_flag is defined %}[custom={{ custom_flag }}]{%- endif %}"
)
CASES = {
    "none": (None, None),
    "thinking-off": ({"enable_thinking": False}, None),
    "thinking-on": ({"enable_thinking": True}, None),
    "effort-none": (None, "none"),
    "effort-high": (None, "high"),
    "kwargs-win-over-effort-for-thinking": ({"enable_thinking": True}, "none"),
    "effort-in-kwargs": ({"reasoning_effort": "low"}, None),
    "request-effort-wins": ({"reasoning_effort": "low"}, "high"),
    "custom-and-unknown": ({"custom_flag": 3, "unknown": 1}, None),
    "generation-prompt-is-the-request's": ({"add_generation_prompt": False}, None),
}
NO_TOOLS = ToolCallSettings(parser=None, enable_auto_tool_choice=False)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


def _body(kwargs, effort) -> dict:
    body: dict = {"messages": [{"role": "user", "content": "Hi"}]}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    if effort is not None:
        body["reasoning_effort"] = effort
    return body


@pytest.mark.parametrize("case", CASES)
def test_the_template_sees_what_vllm_hands_it(hf_tokenizer, case):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest
    from vllm.renderers.hf import safe_apply_chat_template

    kwargs, effort = CASES[case]
    body = _body(kwargs, effort)
    params = VllmRequest.model_validate(body).build_chat_params(TEMPLATE, "auto")
    expected = safe_apply_chat_template(
        None, hf_tokenizer, [{"role": "user", "content": "Hi"}], chat_template=TEMPLATE, tools=None, tokenize=False,
        **params.chat_template_kwargs,
    )  # fmt: skip
    request = ChatCompletionRequest.model_validate(body)
    check_chat_request(request, NO_TOOLS)
    ours = ChatTemplate(TEMPLATE, {}).render(
        [ConversationMessage("user", "Hi")], add_generation_prompt=request.add_generation_prompt,
        reasoning_effort=request.reasoning_effort, template_kwargs=request.chat_template_kwargs,
    )  # fmt: skip
    assert ours == expected


@pytest.mark.parametrize("name", ["tokenize", "chat_template"])
def test_what_vllm_refuses_is_refused_in_its_words(hf_tokenizer, name):
    from vllm.renderers.hf import resolve_chat_template_kwargs

    with pytest.raises(ValueError) as theirs:
        resolve_chat_template_kwargs(hf_tokenizer, TEMPLATE, {name: True})
    with pytest.raises(OpenAIError) as ours:
        check_chat_request(ChatCompletionRequest.model_validate(_body({name: True}, None)), NO_TOOLS)
    assert ours.value.status == 400 and ours.value.param == "chat_template_kwargs"
    assert ours.value.message == str(theirs.value)
