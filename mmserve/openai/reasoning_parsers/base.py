"""What every reasoning parser gives: a whole answer split into reasoning and content, or a stream's next
delta so split. Each class names the vLLM 0.32 class it mirrors (`vllm.reasoning`).

A parser instance serves one choice of one request; the think-tag parsers keep no state of their own (the
stream's token ids so far are passed in, as vLLM passes them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..message_delta import MessageDelta


def content_delta(text: str) -> MessageDelta:
    """`DeltaMessage(content=text)`."""
    return MessageDelta(content=text)


def reasoning_delta(text: str) -> MessageDelta:
    """`DeltaMessage(reasoning=text)`."""
    return MessageDelta(reasoning=text)


def split_delta(reasoning: str, content: str) -> MessageDelta:
    """`DeltaMessage(reasoning=..., content=content if content else None)`."""
    return MessageDelta(content=content or None, reasoning=reasoning)


class ReasoningParser:
    """vLLM's `ReasoningParser`, for the parsers served here (one per choice, built with the ids of the
    tokens it looks for in the model's vocabulary)."""

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        raise NotImplementedError

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        raise NotImplementedError

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        raise NotImplementedError

    def extract_reasoning_streaming(
        self, delta_text: str, previous_token_ids: Sequence[int], delta_token_ids: Sequence[int]
    ) -> MessageDelta | None:
        """vLLM's method of the same name, without the texts so far, which no parser here reads."""
        raise NotImplementedError

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        raise NotImplementedError
