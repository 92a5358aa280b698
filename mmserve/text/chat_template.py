"""Chat prompt rendering, byte-identical to vLLM's OpenAI chat path.

vLLM turns OpenAI messages into template input (renderers/chat_utils.py), then
calls transformers' ``apply_chat_template`` (renderers/hf.py). Both halves are
reproduced here:

1. ``to_conversation`` (``conversation.py``): OpenAI-style ``ConversationMessage``s -> the plain dicts the
   template sees, in one of two "content formats" detected from the template
   AST (``detect_content_format``, ``template_env.py``): "openai" keeps content as a list of
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
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.meta

from ..model_files import ModelFiles
from .conversation import ContentFormat, ConversationMessage, MediaPlaceholders, developer_to_system, to_conversation
from .template_env import CONTINUE_TAG, JINJA_ENV, detect_content_format


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
        self._template = JINJA_ENV.from_string(source)
        self._variables = frozenset(jinja2.meta.find_undeclared_variables(JINJA_ENV.parse(source)))
        self._supports_developer = '"developer"' in source or "'developer'" in source

    def render(
        self,
        messages: list[ConversationMessage],
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
            conversation = developer_to_system(conversation)

        # vLLM's `build_chat_params`: the request's template kwargs, then its reasoning effort where given
        # (with enable_thinking unless the kwargs set it); kept only if the template declares them.
        extra: dict[str, Any] = dict(template_kwargs or {})
        if reasoning_effort is not None:
            extra["reasoning_effort"] = reasoning_effort
            extra.setdefault("enable_thinking", reasoning_effort != "none")
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
                    block["text"] = block["text"] + CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue")
        else:
            last["content"] = final + CONTINUE_TAG
        rendered = self._template.render(
            messages=conversation, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )
        if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
            raise ValueError("continue_final_message is set but the final message does not appear in the chat")
        tag_loc = rendered.rindex(CONTINUE_TAG.strip())
        if rendered[tag_loc : tag_loc + len(CONTINUE_TAG)] == CONTINUE_TAG:
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
