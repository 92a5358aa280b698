"""What every reasoning parser gives: a whole answer split into reasoning and content, or a stream's next
delta so split. Each class names the vLLM 0.32 class it mirrors (`vllm.reasoning`).

A parser instance serves one choice of one request; the think-tag parsers keep no state of their own (the
stream's token ids so far are passed in, as vLLM passes them); the engine-based ones (`parser_engine.py`)
keep theirs. A `ReasoningSetup` is one parser bound to a model's tokenizer, made once per model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

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

    # vLLM's `engine_based_streaming`: False, the stream's reasoning ends on a delta with the end token;
    # True, it ends when `has_engine_confirmed_reasoning_end()`, and `finish_streaming()` gives what the
    # parser still holds (see `parser_engine.py`).
    engine_based = False

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

    def has_engine_confirmed_reasoning_end(self) -> bool:
        raise NotImplementedError

    def finish_streaming(self) -> MessageDelta | None:
        raise NotImplementedError


class ReasoningSetup(Protocol):
    """A reasoning parser bound to one model's tokenizer (a configuration error is raised when it is made)."""

    name: str

    @property
    def engine_based(self) -> bool:
        """Its parsers are engine-based: vLLM's `adjust_request` then turns `skip_special_tokens` off for
        every request, so that the parser sees the special tokens it names or drops."""
        ...

    def parser(self, chat_template_kwargs: dict[str, Any] | None = None) -> ReasoningParser:
        """A parser for one choice; `chat_template_kwargs`: the request's, merged as vLLM merges them."""
        ...
