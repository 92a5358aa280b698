"""Chat prompts vs vLLM's own chat path (chat_utils message parsing +
safe_apply_chat_template, i.e. transformers' apply_chat_template)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mmserve.text import (
    ConversationMessage,
    MediaContent,
    MediaPlaceholders,
    ModelFiles,
    TextContent,
    Tokenizer,
    ToolCall,
    detect_content_format,
    load_chat_template,
)

IMG = MediaContent("image")
VID = MediaContent("video")

CONVERSATIONS: dict[str, list[ConversationMessage]] = {
    "single_user_default_system": [ConversationMessage("user", "Hello there!")],
    "system_prompt": [ConversationMessage("system", "You are terse."), ConversationMessage("user", "Say hi")],
    "multi_turn": [
        ConversationMessage("system", "Be nice."),
        ConversationMessage("user", "What is 2+2?"),
        ConversationMessage("assistant", "4"),
        ConversationMessage("user", "And 3+3?"),
        ConversationMessage("assistant", "6"),
        ConversationMessage("user", "Thanks"),
    ],
    "unicode": [ConversationMessage("user", "你好，世界！😀🎉 Ünïcödé café — こんにちは 🇫🇷\n\tend")],
    "text_parts": [ConversationMessage("user", [TextContent("first part"), TextContent("second part"), TextContent("")])],
    "image_parts": [
        ConversationMessage("user", [TextContent("Look:"), IMG, TextContent("and this"), IMG, TextContent("what differs?")])
    ],
    "image_only": [ConversationMessage("user", [IMG])],
    "video_and_image": [ConversationMessage("user", [VID, TextContent("describe"), IMG])],
    "empty_content": [ConversationMessage("user", "")],
    "empty_list_content": [ConversationMessage("system", "sys"), ConversationMessage("user", [])],
    "assistant_tool_calls": [
        ConversationMessage("user", "weather?"),
        ConversationMessage("assistant", None, tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        ConversationMessage("tool", [TextContent("sunny"), TextContent("22C")], tool_call_id="call_1"),
        ConversationMessage("user", "thanks"),
    ],
    "developer_role": [
        ConversationMessage("user", "hi"),
        ConversationMessage("developer", "Answer in French."),
        ConversationMessage("system", "Be brief."),
        ConversationMessage("user", "ok"),
    ],
    "named_user": [ConversationMessage("user", "hi", name="bob"), ConversationMessage("assistant", "yo", reasoning="thinking")],
    "billing_header": [ConversationMessage("system", "x-anthropic-billing-header: cch=123\nReal system"), ConversationMessage("user", "q")],
}

# Conversations the llama-style test template (user/assistant alternation, no
# tool/developer roles) can render.
LLAMA_OK = {"single_user_default_system", "system_prompt", "multi_turn", "unicode", "text_parts", "image_parts",
            "image_only", "video_and_image", "empty_content", "empty_list_content", "billing_header"}  # fmt: skip

PLACEHOLDERS = {
    "qwen": MediaPlaceholders(
        image="<|vision_start|><|image_pad|><|vision_end|>", video="<|vision_start|><|video_pad|><|vision_end|>"
    ),
    "llama": MediaPlaceholders(image="<image>", video="<video>"),
}


def _placeholders(model_dir: Path) -> MediaPlaceholders:
    return PLACEHOLDERS["llama"] if "llama" in str(model_dir) else PLACEHOLDERS["qwen"]


def _to_openai(msg: ConversationMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": msg.role}
    if isinstance(msg.content, str) or msg.content is None:
        out["content"] = msg.content
    else:
        parts: list[dict[str, Any]] = []
        for p in msg.content:
            if isinstance(p, TextContent):
                parts.append({"type": "text", "text": p.text})
            else:
                key = f"{p.modality}_url"
                parts.append({"type": key, key: {"url": f"http://example/{p.modality}"}})
        out["content"] = parts
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_calls is not None:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in msg.tool_calls
        ]
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.reasoning is not None:
        out["reasoning"] = msg.reasoning
    return out


class _FakeParser:
    """Stands in for vLLM's MultiModalContentParser: records the model's
    placeholder per media item instead of fetching media."""

    model_config = SimpleNamespace(enable_prompt_embeds=False)

    def __init__(self, placeholders: MediaPlaceholders) -> None:
        self._placeholders = placeholders
        self._storage: dict[str, list[str]] = defaultdict(list)

    def _add(self, modality: str) -> None:
        if placeholder := self._placeholders.for_modality(modality):  # type: ignore[arg-type]
            self._storage[f"<##{modality.upper()}##>"].append(placeholder)

    def parse_image(self, url: str | None, uuid: str | None = None) -> None:
        self._add("image")

    def parse_video(self, url: str | None, uuid: str | None = None) -> None:
        self._add("video")

    def mm_placeholder_storage(self) -> dict[str, list[str]]:
        return dict(self._storage)


class _FakeTracker:
    def __init__(self, placeholders: MediaPlaceholders) -> None:
        self._placeholders = placeholders

    def create_parser(self, mm_processor_kwargs: Any = None) -> _FakeParser:
        return _FakeParser(self._placeholders)


def _vllm_conversation(messages: list[ConversationMessage], content_format: str, placeholders: MediaPlaceholders) -> list:
    from vllm.renderers import chat_utils

    conversation: list = []
    tracker = _FakeTracker(placeholders)
    for msg in messages:
        conversation.extend(
            chat_utils._parse_chat_message_content(_to_openai(msg), tracker, content_format, interleave_strings=False)
        )
    chat_utils._postprocess_messages(conversation)
    return conversation


def _vllm_developer_fallback(conversation: list, template: str) -> list:
    """The developer->system step safe_apply_chat_template runs before rendering."""
    from vllm.renderers import hf

    if any(m["role"] == "developer" for m in conversation) and not hf._detect_developer_role_support(template):
        conversation = hf._consolidate_system_messages(hf._convert_developer_to_system(conversation))
    return conversation


def _cases(model_dir: Path) -> list[str]:
    return sorted(LLAMA_OK) if "llama" in str(model_dir) else sorted(CONVERSATIONS)


def test_content_format_detection_matches_vllm(model_dir: Path) -> None:
    from vllm.renderers.hf import _detect_content_format

    template = ModelFiles.load(model_dir).chat_template.text
    assert detect_content_format(template) == _detect_content_format(template, default="string")


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
        "{% for m in messages %}{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}"
        "{{ c.text }}{% endfor %}{% endfor %}",
        "{% set msgs = messages[1:] %}{% for m in msgs %}{% for c in m.content %}x{% endfor %}{% endfor %}",
        "{% macro r(content) %}{% for c in content %}{{ c }}{% endfor %}{% endmacro %}"
        "{% for message in messages %}{{ r(message.content) }}{% endfor %}",
        "{% macro r(x) %}{% for c in x %}{{ c }}{% endfor %}{% endmacro %}"
        "{% for message in messages %}{{ r(x=message['content']) }}{% endfor %}",
        "{% for message in messages %}{% set content = message.content %}{% for c in content %}{% endfor %}"
        "{% endfor %}",
        "{% generation %}{{ messages[0].content }}{% endgeneration %}",
    ],
)
def test_content_format_detection_variants(template: str) -> None:
    from vllm.renderers.hf import _detect_content_format

    assert detect_content_format(template) == _detect_content_format(template, default="string")


def test_rendered_prompt_and_ids_match_vllm(model_dir: Path, hf_tokenizer) -> None:
    from vllm.renderers.hf import safe_apply_chat_template

    files = ModelFiles.load(model_dir)
    placeholders = _placeholders(model_dir)
    template = load_chat_template(files, placeholders)
    tokenizer = Tokenizer.from_model_files(files)
    for name in _cases(model_dir):
        messages = CONVERSATIONS[name]
        for add_generation_prompt in (True, False):
            ours = template.render(messages, add_generation_prompt=add_generation_prompt)
            conversation = _vllm_conversation(messages, template.content_format, placeholders)
            kwargs = dict(add_generation_prompt=add_generation_prompt, continue_final_message=False,
                          documents=None, reasoning_effort=None)  # fmt: skip
            expected = hf_tokenizer.apply_chat_template(
                _vllm_developer_fallback(conversation, template.source),
                chat_template=template.source, tokenize=False, **kwargs,
            )  # fmt: skip
            assert ours == expected, name
            expected_ids = safe_apply_chat_template(
                None, hf_tokenizer, conversation, chat_template=template.source, **kwargs
            )
            assert tokenizer.encode(ours, add_special_tokens=False) == expected_ids, name


def test_continue_final_message_matches_transformers(model_dir: Path, hf_tokenizer) -> None:
    files = ModelFiles.load(model_dir)
    placeholders = _placeholders(model_dir)
    template = load_chat_template(files, placeholders)
    for last in ("The answer is", "Trailing space ", [TextContent("part one"), TextContent("part two")]):
        messages = [ConversationMessage("user", "Question?"), ConversationMessage("assistant", last)]
        ours = template.render(messages, add_generation_prompt=False, continue_final_message=True)
        conversation = _vllm_conversation(messages, template.content_format, placeholders)
        expected = hf_tokenizer.apply_chat_template(
            conversation, chat_template=template.source, tokenize=False,
            add_generation_prompt=False, continue_final_message=True,
        )  # fmt: skip
        assert ours == expected


def test_template_kwargs_and_errors(qwen_dir: Path) -> None:
    template = load_chat_template(ModelFiles.load(qwen_dir), PLACEHOLDERS["qwen"])
    msgs = [ConversationMessage("user", [IMG, IMG])]
    with_ids = template.render(msgs, template_kwargs={"add_vision_id": True, "unknown_var": 1})
    assert "Picture 1: <|vision_start|>" in with_ids and "Picture 2:" in with_ids
    with pytest.raises(ValueError):
        template.render([])
    with pytest.raises(ValueError):
        template.render(msgs, add_generation_prompt=True, continue_final_message=True)


def test_default_template_resolution_matches_vllm(model_dir: Path, hf_tokenizer) -> None:
    from vllm.renderers.hf import resolve_chat_template

    model_config = SimpleNamespace(
        tokenizer_revision=None, code_revision=None, tokenizer=str(model_dir), model=str(model_dir),
        trust_remote_code=False, hf_config=SimpleNamespace(model_type="none"),
    )  # fmt: skip
    expected = resolve_chat_template(hf_tokenizer, None, None, model_config=model_config)
    assert ModelFiles.load(model_dir).chat_template.text == expected
