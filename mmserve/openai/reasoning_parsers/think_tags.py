"""Reasoning between a start and an end tag that are single tokens of the model (`<think>`, `</think>`):
vLLM 0.32's `BaseThinkingReasoningParser`, read for read, and `DeepSeekR1ReasoningParser` on it, which
also takes a stream whose start tag is in the prompt (the chat template wrote it) as reasoning.
(`extract_content_ids` is left out: it gives the tool-call parser token ids, which none here reads.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from mmserve.text import Tokenizer

from ..message_delta import MessageDelta
from .base import ReasoningParser, content_delta, reasoning_delta, split_delta


class ThinkTagReasoningParser(ReasoningParser):
    """vLLM's `BaseThinkingReasoningParser`."""

    start_token: str
    end_token: str

    def __init__(self, start_token_id: int, end_token_id: int) -> None:
        self.start_token_id = start_token_id
        self.end_token_id = end_token_id

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """The last of the two tags in `input_ids` is the end tag."""
        for token_id in reversed(input_ids):
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
        return False

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        return self.end_token_id in delta_ids

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer: a start tag is dropped; without an end tag it is all
        reasoning (the model may write no start tag); nothing after the end tag is null content."""
        before, start, after = model_output.partition(self.start_token)
        model_output = after if start else before
        if self.end_token not in model_output:
            return model_output, None
        reasoning, _, content = model_output.partition(self.end_token)
        return reasoning, content or None

    def extract_reasoning_streaming(
        self, delta_text: str, previous_token_ids: Sequence[int], delta_token_ids: Sequence[int]
    ) -> MessageDelta | None:
        start_id, end_id = self.start_token_id, self.end_token_id
        if len(delta_token_ids) == 1 and delta_token_ids[0] in (start_id, end_id):
            return None  # a tag alone shows nothing
        if start_id in previous_token_ids:
            if end_id in delta_token_ids:
                end = delta_text.find(self.end_token)
                return split_delta(delta_text[:end], delta_text[end + len(self.end_token) :])
            if end_id in previous_token_ids:
                return content_delta(delta_text)
            return reasoning_delta(delta_text)
        if start_id in delta_token_ids:
            if end_id in delta_token_ids:
                start, end = delta_text.find(self.start_token), delta_text.find(self.end_token)
                return split_delta(delta_text[start + len(self.start_token) : end], delta_text[end + len(self.end_token) :])
            return reasoning_delta(delta_text)
        return content_delta(delta_text)  # no start tag (yet)

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens inside start/end tags (nested spans counted once; a stray end tag ignored)."""
        count = depth = 0
        for token_id in token_ids:
            if token_id == self.start_token_id:
                depth += 1
            elif token_id == self.end_token_id:
                depth = max(0, depth - 1)
            elif depth > 0:
                count += 1
        return count


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """vLLM's `DeepSeekR1ReasoningParser`: `<think>…</think>`; a stream with no start tag in its own
    tokens is reasoning until the end tag (the template put the start tag in the prompt)."""

    start_token = "<think>"
    end_token = "</think>"

    def extract_reasoning_streaming(
        self, delta_text: str, previous_token_ids: Sequence[int], delta_token_ids: Sequence[int]
    ) -> MessageDelta | None:
        delta = super().extract_reasoning_streaming(delta_text, previous_token_ids, delta_token_ids)
        if delta is None or self.start_token_id in previous_token_ids or self.start_token_id in delta_token_ids:
            return delta
        if self.end_token_id in delta_token_ids:
            end = delta_text.find(self.end_token)
            return split_delta(delta_text[:end], delta_text[end + len(self.end_token) :])
        if self.end_token_id in previous_token_ids:
            return content_delta(delta_text)
        return reasoning_delta(delta_text)


class ThinkTagReasoningSetup:
    """A think-tag parser with the ids of its tags in the model's tokenizer, found once per model."""

    engine_based = False

    def __init__(self, parser_class: type[ThinkTagReasoningParser], name: str, tokenizer: Tokenizer) -> None:
        start, end = tokenizer.token_to_id(parser_class.start_token), tokenizer.token_to_id(parser_class.end_token)
        if start is None or end is None:
            # vLLM fails every request then; found here at start.
            raise ValueError(
                f"reasoning_parser {name!r} needs {parser_class.start_token} and {parser_class.end_token} as tokens "
                "of the model's tokenizer, and this tokenizer has no such tokens"
            )
        self.name = name
        self.parser_class = parser_class
        self.start_token_id, self.end_token_id = start, end

    def parser(self, chat_template_kwargs: dict[str, Any] | None = None) -> ThinkTagReasoningParser:
        return self.parser_class(self.start_token_id, self.end_token_id)
