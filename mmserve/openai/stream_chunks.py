"""Streamed delta chunks rendered straight to SSE bytes: msgspec structs, one JSON encoding per chunk.

A stream sends one chunk per engine step, so this is the per-token path of the HTTP side: no
pydantic model is built for it. Each request's constant part (`{"id":…,"object":…,"created":…,
"model":…,"choices":[`) is encoded once; per chunk only the choice is encoded. The bytes equal
what the pydantic models of `protocol.py` give with `model_dump_json(exclude_none=True)`
(`tests/openai/test_stream_chunks.py`), which is what vLLM's server sends. The rare chunks
(the opening role chunk, usage, errors) still go through those models.
"""

from __future__ import annotations

import msgspec

from .logprobs import ChatLogprobs, CompletionLogprobs
from .output_processing import ChoiceDelta
from .message_delta import MessageDelta

_encode = msgspec.json.Encoder().encode


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """`DeltaMessage`, as a delta chunk carries it (never the role)."""

    content: str


class ChatStreamChoice(msgspec.Struct, omit_defaults=True):
    """`ChatCompletionStreamChoice`."""

    index: int
    delta: ChatDelta | MessageDelta
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class CompletionStreamChoice(msgspec.Struct, omit_defaults=True):
    """`CompletionChoice` in a stream."""

    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class DeltaChunks:
    """One streamed request's delta chunks, as complete SSE events (bytes)."""

    def __init__(self, object_name: str, request_id: str, created: int, model: str) -> None:
        self._head = b"".join((
            b'data: {"id":', _encode(request_id), b',"object":', _encode(object_name),
            b',"created":', _encode(created), b',"model":', _encode(model), b',"choices":[',
        ))

    def _event(self, choice: msgspec.Struct) -> bytes:
        return b"".join((self._head, _encode(choice), b"]}\n\n"))

    def chat(self, delta: ChoiceDelta, with_ids: bool) -> bytes:
        return self._event(ChatStreamChoice(
            delta.index, ChatDelta(delta.text), delta.finish_reason, delta.stop_reason,
            None if delta.logprobs is None else ChatLogprobs(delta.logprobs), delta.token_ids if with_ids else None,
        ))

    def chat_parsed(
        self, delta: ChoiceDelta, message: MessageDelta | None, finish_reason: str | None, with_ids: bool, metadata: bool
    ) -> bytes:
        """A chunk of a stream read by the model's parsers: its `message` (`ChoiceOutput.delta`; None:
        `DeltaMessage()`), the finish reason they decided; no logprobs or token ids unless `metadata`."""
        shown = MessageDelta() if message is None else message
        logprobs = None if delta.logprobs is None or not metadata else ChatLogprobs(delta.logprobs)
        return self._event(ChatStreamChoice(
            delta.index, shown, finish_reason, delta.stop_reason, logprobs, delta.token_ids if with_ids and metadata else None,
        ))

    def completion(
        self, delta: ChoiceDelta, with_ids: bool, prompt_token_ids: list[int] | None, logprobs: CompletionLogprobs | None = None
    ) -> bytes:
        return self._event(CompletionStreamChoice(
            delta.index, delta.text, delta.finish_reason, delta.stop_reason,
            logprobs, delta.token_ids if with_ids else None, prompt_token_ids,
        ))
