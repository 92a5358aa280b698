"""Chat prompt rendering, byte-identical to vLLM's OpenAI chat path.

vLLM turns OpenAI messages into template input (renderers/chat_utils.py), then
calls transformers' ``apply_chat_template`` (renderers/hf.py). Both halves are
reproduced here:

1. ``to_conversation``: OpenAI-style ``ChatMessage``s -> the plain dicts the
   template sees, in one of two "content formats" detected from the template
   AST (``detect_content_format``): "openai" keeps content as a list of
   ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts, "string"
   joins text parts with "\\n" and prepends one placeholder per media item.
2. ``ChatTemplate.render``: the same sandboxed Jinja environment and variables
   as transformers (trim_blocks, lstrip_blocks, loopcontrols, ``{% generation %}``,
   ``raise_exception``, ``tojson``, ``strftime_now``, special tokens, tools=None,
   documents=None), including ``continue_final_message``.

The rendered prompt is then tokenized with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .model_files import ModelFiles

ContentFormat = Literal["string", "openai"]
Modality = Literal["image", "video", "audio"]


# ---------------------------------------------------------------------------
# Typed input (the HTTP schema layer converts OpenAI JSON into these)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class MediaPart:
    """A media item (the data itself is handled by the multimodal layer; only
    its position matters to the prompt)."""

    modality: Modality = "image"


ContentPart = TextPart | MediaPart


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ChatMessage:
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
# Jinja environment (transformers' _compile_jinja_template)
# ---------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged
    (transformers only uses it to compute assistant masks)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Unlike Jinja's own tojson: no HTML escaping, non-ASCII kept.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()

# Marker transformers appends to the final message for continue_final_message.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# ---------------------------------------------------------------------------
# Content-format detection (vLLM renderers/hf.py _detect_content_format)
# ---------------------------------------------------------------------------


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == varname


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var_access(node.node, varname)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _assigned_aliases(root: jinja2.nodes.Template, varname: str) -> list[str]:
    """``varname`` plus every variable assigned from it (transitively)."""
    names = [varname]
    pending = deque([varname])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems_access(assign.node, current):
                assert isinstance(assign.target, jinja2.nodes.Name)
                names.append(assign.target.name)
                if assign.target.name != current:
                    pending.append(assign.target.name)
    return names


def _message_loop_targets(root: jinja2.nodes.Template) -> list[str]:
    """Names bound by ``{% for message in messages %}``-style loops."""
    aliases = _assigned_aliases(root, "messages")
    targets = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, name) for name in aliases):
            assert isinstance(loop.target, jinja2.nodes.Name)
            targets.append(loop.target.name)
    return targets


def _has_content_loop(root: jinja2.nodes.Template) -> bool:
    """Whether the template iterates over a message's content (directly, via a
    macro parameter bound to ``message.content``, or a top-level ``content``)."""
    message_vars = _message_loop_targets(root)

    def is_content_of_message(node: jinja2.nodes.Node) -> bool:
        return any(_is_var_or_elems_access(node, var, "content") for var in message_vars)

    macro_content_params: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and is_content_of_message(arg):
                        content_params.add(macro.args[i].name)
                for kwarg in call.kwargs:
                    if kwarg.key in param_names and is_content_of_message(kwarg.value):
                        content_params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                macro_content_params[id(loop)] = content_params

    for loop in root.find_all(jinja2.nodes.For):
        if is_content_of_message(loop.iter):
            return True
        params = macro_content_params.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name):
            if params is not None and loop.iter.name in params:
                return True
            if id(loop) not in loops_in_macros and loop.iter.name == "content":
                return True
    return False


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """"openai" if the template loops over message content, else "string"
    (vLLM's ``--chat-template-content-format auto``)."""
    try:
        ast = _ENV.parse(template)
        return "openai" if _has_content_loop(ast) else "string"
    except Exception:
        return "string"


# ---------------------------------------------------------------------------
# OpenAI messages -> template conversation (vLLM renderers/chat_utils.py)
# ---------------------------------------------------------------------------

# Claude Code puts a per-request header line in its system prompt; vLLM strips
# it so the prompt prefix stays cacheable.
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"


def _strip_billing_header(parts: list[ContentPart]) -> list[ContentPart]:
    out: list[ContentPart] = []
    for part in parts:
        if not (isinstance(part, TextPart) and part.text.startswith(_CLAUDE_CODE_BILLING_HEADER)):
            out.append(part)
            continue
        rest = part.text.partition("\n")[2]
        if rest:
            out.append(TextPart(rest))
    return out


def _string_content(parts: list[ContentPart], placeholders: MediaPlaceholders) -> str:
    """"string" format: texts joined by "\\n"; media placeholders not already
    written by the user are prepended, one per item (vLLM
    ``_get_full_multimodal_text_prompt`` with interleave_strings=False)."""
    # Empty texts are dropped (vLLM appends only truthy parse results).
    texts = [p.text for p in parts if isinstance(p, TextPart) and p.text]
    by_modality: dict[str, list[str]] = {}
    for part in parts:
        if isinstance(part, MediaPart) and (placeholder := placeholders.for_modality(part.modality)):
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
        {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": p.modality} for p in parts
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
    messages: list[ChatMessage],
    content_format: ContentFormat,
    placeholders: MediaPlaceholders = MediaPlaceholders(),
) -> list[dict[str, Any]]:
    """The ``conversation`` vLLM passes to ``apply_chat_template``."""
    conversation: list[dict[str, Any]] = []
    for msg in messages:
        if msg.content is None:
            parts: list[ContentPart] = []
        elif isinstance(msg.content, str):
            parts = [TextPart(msg.content)]
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


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------


class ChatTemplate:
    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str],
        *,
        content_format: ContentFormat | None = None,
        placeholders: MediaPlaceholders = MediaPlaceholders(),
    ) -> None:
        """``special_tokens``: name -> token text (bos_token, eos_token, ...,
        model-specific ``*_token``), passed to the template as transformers does."""
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.content_format: ContentFormat = content_format or detect_content_format(source)
        self.placeholders = placeholders
        self._template = _ENV.from_string(source)
        self._variables = frozenset(jinja2.meta.find_undeclared_variables(_ENV.parse(source)))
        self._supports_developer = '"developer"' in source or "'developer'" in source

    def render(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        reasoning_effort: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text vLLM renders for a chat completion request.
        ``tools``: OpenAI tool JSON schemas, passed to the template untouched."""
        conversation = to_conversation(messages, self.content_format, self.placeholders)
        return self.render_conversation(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            reasoning_effort=reasoning_effort,
            tools=tools,
            template_kwargs=template_kwargs,
        )

    def render_conversation(
        self,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        reasoning_effort: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
        if not self._supports_developer and any(m["role"] == "developer" for m in conversation):
            conversation = _developer_to_system(conversation)

        # vLLM always offers reasoning_effort (and enable_thinking when effort is
        # given) but keeps extra kwargs only if the template declares them.
        extra: dict[str, Any] = {"reasoning_effort": reasoning_effort}
        if reasoning_effort is not None:
            extra["enable_thinking"] = reasoning_effort != "none"
        extra.update(template_kwargs or {})
        variables = {
            **self.special_tokens,
            **{k: v for k, v in extra.items() if k in self._variables and k not in _RESERVED_KWARGS},
        }
        variables["tools"] = tools
        if continue_final_message:
            return self._render_continuing(conversation, variables, add_generation_prompt)
        return self._template.render(
            messages=conversation, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )

    def _render_continuing(
        self, conversation: list[dict[str, Any]], variables: dict[str, Any], add_generation_prompt: bool
    ) -> str:
        """transformers' continue_final_message: tag the final message's text,
        render, then cut the prompt right where the tag starts."""
        conversation = json.loads(json.dumps(conversation))  # deep copy of plain data
        last = conversation[-1]
        final = last.get("content")
        if final is None:
            raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
        if "content" not in self.source:
            raise ValueError('continue_final_message is set to "content" but this is not an accepted field')
        if isinstance(final, list):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue")
        else:
            last["content"] = final + _CONTINUE_TAG
        rendered = self._template.render(
            messages=conversation, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )
        if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise ValueError("continue_final_message is set but the final message does not appear in the chat")
        tag_loc = rendered.rindex(_CONTINUE_TAG.strip())
        if rendered[tag_loc : tag_loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:tag_loc]
        return rendered[:tag_loc].rstrip()  # the template trimmed trailing spaces


# Names bound by apply_chat_template itself; a request cannot override them
# through chat_template_kwargs (vLLM rejects / consumes them).
_RESERVED_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize"}
)



def load_chat_template(files: ModelFiles, placeholders: MediaPlaceholders = MediaPlaceholders()) -> ChatTemplate:
    """The model's default chat template, with its tokenizer's special tokens."""
    if files.chat_template is None:
        raise ValueError(f"{files.path} defines no chat template")
    return ChatTemplate(
        files.chat_template.text,
        dict(files.tokenizer_config.named_special_tokens),
        placeholders=placeholders,
    )
