"""OpenAI-style messages -> the conversation a chat template sees (vLLM renderers/chat_utils.py).

The HTTP schema layer converts OpenAI JSON into `ConversationMessage`s; `to_conversation` turns
them into the plain dicts the template gets, in the template's content format: "openai" keeps
content as a list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts, "string"
joins text parts with "\\n" and prepends one placeholder per media item.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]
Modality = Literal["image", "video", "audio"]


# ---------------------------------------------------------------------------
# Typed input
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TextContent:
    text: str


@dataclass(frozen=True, slots=True)
class MediaContent:
    """A media item (the data itself is handled by the multimodal layer; only
    its position matters to the prompt)."""

    modality: Modality = "image"


ContentPart = TextContent | MediaContent


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ConversationMessage:
    role: str  # "system" | "developer" | "user" | "assistant" | "tool" | ...
    content: str | tuple[ContentPart, ...] | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None


@dataclass(frozen=True, slots=True)
class MediaPlaceholders:
    """Per-model placeholder text for "string"-format templates (vLLM's
    ``get_placeholder_str``); e.g. Qwen2-VL's image placeholder is
    ``<|vision_start|><|image_pad|><|vision_end|>``."""

    image: str | None = None
    video: str | None = None
    audio: str | None = None

    def for_modality(self, modality: Modality) -> str | None:
        return getattr(self, modality)


# ---------------------------------------------------------------------------
# OpenAI messages -> template conversation
# ---------------------------------------------------------------------------

# Claude Code puts a per-request header line in its system prompt; vLLM strips
# it so the prompt prefix stays cacheable.
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"


def _strip_billing_header(parts: list[ContentPart]) -> list[ContentPart]:
    out: list[ContentPart] = []
    for part in parts:
        if not (isinstance(part, TextContent) and part.text.startswith(_CLAUDE_CODE_BILLING_HEADER)):
            out.append(part)
            continue
        rest = part.text.partition("\n")[2]
        if rest:
            out.append(TextContent(rest))
    return out


def _string_content(parts: list[ContentPart], placeholders: MediaPlaceholders) -> str:
    """"string" format: texts joined by "\\n"; media placeholders not already
    written by the user are prepended, one per item (vLLM
    ``_get_full_multimodal_text_prompt`` with interleave_strings=False)."""
    # Empty texts are dropped (vLLM appends only truthy parse results).
    texts = [p.text for p in parts if isinstance(p, TextContent) and p.text]
    by_modality: dict[str, list[str]] = {}
    for part in parts:
        if isinstance(part, MediaContent) and (placeholder := placeholders.for_modality(part.modality)):
            by_modality.setdefault(part.modality, []).append(placeholder)
    text_prompt = "\n".join(texts)
    if not by_modality:
        return text_prompt
    counts = Counter(p for items in by_modality.values() for p in items)
    missing: list[str] = []
    for placeholder in counts:
        remaining = counts[placeholder] - text_prompt.count(placeholder)
        if remaining < 0:
            raise ValueError(
                f"Found more '{placeholder}' placeholders in input prompt than actual multimodal data items."
            )
        missing.extend([placeholder] * remaining)
    return "\n".join(missing + [text_prompt]) if text_prompt else "\n".join(missing)


def _openai_content(parts: list[ContentPart]) -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": p.text} if isinstance(p, TextContent) else {"type": p.modality} for p in parts
    ]


def _tool_call_dict(call: ToolCall) -> dict[str, Any]:
    # Templates expect arguments as a mapping; vLLM parses the JSON string and
    # coerces invalid / non-object arguments to {}.
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def to_conversation(
    messages: list[ConversationMessage],
    content_format: ContentFormat,
    placeholders: MediaPlaceholders = MediaPlaceholders(),
) -> list[dict[str, Any]]:
    """The ``conversation`` vLLM passes to ``apply_chat_template``."""
    conversation: list[dict[str, Any]] = []
    for msg in messages:
        if msg.content is None:
            parts: list[ContentPart] = []
        elif isinstance(msg.content, str):
            parts = [TextContent(msg.content)]
        else:
            parts = list(msg.content)
        if msg.role == "system":
            parts = _strip_billing_header(parts)

        content: Any
        if content_format == "openai":
            content = _openai_content(parts)
        else:
            content = _string_content(parts, placeholders)
        out: dict[str, Any] = {"role": msg.role, "content": content}

        if msg.role == "assistant":
            # An empty tool_calls list is dropped so templates take the plain path.
            if msg.tool_calls:
                out["tool_calls"] = [_tool_call_dict(c) for c in msg.tool_calls]
            if msg.reasoning is not None:
                out["reasoning"] = msg.reasoning
                out["reasoning_content"] = msg.reasoning
        elif msg.role == "tool":
            if msg.tool_call_id is not None:
                out["tool_call_id"] = msg.tool_call_id
            # Most templates only handle string tool results.
            if isinstance(content, list) and all(item.get("type") == "text" for item in content):
                out["content"] = "\n".join(item["text"] for item in content)
        if msg.name is not None:
            out["name"] = msg.name
        if msg.role == "developer":
            out["tools"] = None
        conversation.append(out)
    return conversation


def developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Templates without a 'developer' role get developer messages as system
    messages, all system messages merged into one at the front (vLLM)."""
    converted = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"}
            msg["role"] = "system"
        converted.append(msg)

    system_texts: list[str] = []
    others: list[dict[str, Any]] = []
    needs_merge = False
    for i, msg in enumerate(converted):
        if msg["role"] != "system":
            others.append(msg)
            continue
        if i > 0 or system_texts:
            needs_merge = True
        content = msg.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            system_texts.append(content)
    if not needs_merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]
