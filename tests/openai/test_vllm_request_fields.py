"""vLLM's request fields that mmserve does not implement are refused when set, never silently ignored.

A request setting one of them to anything but vLLM's default gets a 400 naming the field (`vllm serve`
would answer it differently); at the default it is served. The tables of mmserve/openai/request_checks.py
are checked against vLLM 0.32's own request models (reference venv): every field vLLM's chat and
completion requests have is implemented, refused off its default, or answer-neutral here.
"""

from __future__ import annotations

import pytest

from mmserve.openai.errors import OpenAIError
from mmserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from mmserve.openai.settings import ToolCallSettings
from mmserve.openai.request_checks import (
    NEUTRAL_VLLM_FIELDS,
    NOT_IMPLEMENTED_CHAT_FIELDS,
    NOT_IMPLEMENTED_COMPLETION_FIELDS,
    check_chat_request,
    check_completion_request,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}
NO_TOOL_PARSER = ToolCallSettings(parser=None, enable_auto_tool_choice=False)
ENDPOINTS = {
    "chat": (ChatCompletionRequest, CHAT, lambda request: check_chat_request(request, NO_TOOL_PARSER), NOT_IMPLEMENTED_CHAT_FIELDS),
    "completions": (CompletionRequest, COMPLETION, check_completion_request, NOT_IMPLEMENTED_COMPLETION_FIELDS),
}


def _other_value(default):
    """A value a client might send that is not the default."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, str):
        return default + "-other"
    return {"key": "value"}  # default None: any setting at all


def _cases():
    for endpoint, (_, _, _, fields) in ENDPOINTS.items():
        for name, default in fields.items():
            yield pytest.param(endpoint, name, default, id=f"{endpoint}-{name}")


@pytest.mark.parametrize(("endpoint", "name", "default"), _cases())
def test_a_vllm_field_off_its_default_is_refused_naming_it_and_served_at_it(endpoint, name, default):
    model, base, check, _ = ENDPOINTS[endpoint]
    check(model.model_validate({**base, name: default}))  # vLLM's default: served
    with pytest.raises(OpenAIError) as refused:
        check(model.model_validate({**base, name: _other_value(default)}))
    assert refused.value.status == 400 and refused.value.param == name
    assert f"{name} is not supported by this server" in str(refused.value)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_answer_neutral_and_unknown_fields_are_served(endpoint):
    model, base, check, _ = ENDPOINTS[endpoint]
    check(model.model_validate({**base, "request_id": "mine", "stream_interval": 4, "length_penalty": 2.0,
                                "some_future_field": [1, 2]}))


def test_tables_cover_vllm_request_models():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletion

    for vllm_model, ours, table in ((VllmChat, ChatCompletionRequest, NOT_IMPLEMENTED_CHAT_FIELDS),
                                    (VllmCompletion, CompletionRequest, NOT_IMPLEMENTED_COMPLETION_FIELDS)):
        implemented = {f.alias or k for k, f in ours.model_fields.items()}
        vllm_fields = {f.alias or k: f for k, f in vllm_model.model_fields.items()}
        uncovered = set(vllm_fields) - implemented - set(table) - NEUTRAL_VLLM_FIELDS
        assert not uncovered, f"{vllm_model.__name__}: vLLM fields neither implemented, refused nor neutral: {sorted(uncovered)}"
        for name, default in table.items():
            assert name in vllm_fields, f"{name} is not a field of vLLM's {vllm_model.__name__}"
            assert vllm_fields[name].get_default(call_default_factory=True) == default, name


def test_openai_fields_vllm_ignores_are_ignored_here_and_listed_in_the_api_reference():
    """OpenAI's own request fields (the `openai` client's) that vLLM's request models lack, and so ignore,
    are ignored here too (served, not refused), and the API reference (docs/api.md) names every one of them."""
    from pathlib import Path

    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletion

    readme = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    openai_params = {
        "chat": (chat_create_params.CompletionCreateParamsBase, VllmChat),
        "completions": (completion_create_params.CompletionCreateParamsBase, VllmCompletion),
    }
    for endpoint, (params, vllm_model) in openai_params.items():
        model, base, check, table = ENDPOINTS[endpoint]
        ignored_by_vllm = sorted(set(params.__annotations__) - set(vllm_model.model_fields))
        assert ignored_by_vllm, endpoint
        for name in ignored_by_vllm:
            assert name not in model.model_fields and name not in table, name
            check(model.model_validate({**base, name: {"any": "value"}}))
            assert f"`{name}`" in readme, f"docs/api.md does not list OpenAI's {name} as ignored"
