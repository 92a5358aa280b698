"""SSE rendering: the event stream shared by chat and text completions (deltas, usage, error event, [DONE]).

A stream is run up to its first event before the HTTP answer starts (`started`), so errors
found on the way (bad images, no engine, admission) get their HTTP status instead of a 200.
After that an error can only travel as an event: `ErrorEvent` marks it, so the ingress can tell
it from the others by type.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from .errors import OpenAIError
from .output_processing import ChoiceDelta
from .protocol import SamplingRequestFields

DONE = "data: [DONE]\n\n"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class ErrorEvent(str):
    """An SSE event that carries an OpenAI error body (the stream failed after it started);
    `message` says why, for the request's log line."""

    message: str = ""


async def started(stream: AsyncIterator[str | bytes]) -> AsyncIterator[str | bytes]:
    """Run `stream` up to its first event; return a stream that yields it and the rest."""
    first = await anext(stream)

    async def chained() -> AsyncIterator[str | bytes]:
        yield first
        async for chunk in stream:
            yield chunk

    return chained()


async def event_stream(
    request: SamplingRequestFields,
    deltas: AsyncIterator[ChoiceDelta],
    delta_chunk: Callable[[ChoiceDelta], str | bytes | None],
    usage_chunk: Callable[[int], str],
    opening: Callable[[], str] | None = None,
) -> AsyncIterator[str | bytes]:
    """Deltas as events (skipping empty ones, and those `delta_chunk` makes nothing of), usage if asked
    for (`usage_chunk(completion tokens)`), then [DONE]; an error after the first event is an `ErrorEvent`."""
    with_ids = bool(request.return_token_ids)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    completion_tokens = 0
    # Wait for the first output before the first event, outside the SSE error handling:
    # errors found until then (bad images, no engine) become HTTP errors (see `started`).
    first_delta = await anext(deltas, None)
    try:
        if opening is not None:
            yield opening()
        async for delta in _prepend(first_delta, deltas):
            completion_tokens += len(delta.token_ids)
            # A token with no text yet (part of a UTF-8 sequence) still goes out when its ids or
            # logprobs were asked for, as vLLM sends it: every token's entry reaches the client.
            if not delta.text and delta.finish_reason is None and not (with_ids and delta.token_ids) and not delta.logprobs:
                continue
            if (chunk := delta_chunk(delta)) is not None:  # None: nothing to send for it
                yield chunk
        if include_usage:
            yield usage_chunk(completion_tokens)
    except OpenAIError as exc:
        event = ErrorEvent(sse(exc.body().model_dump_json()))
        event.message = exc.message
        yield event
    yield DONE


async def _prepend(first: ChoiceDelta | None, rest: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
    if first is None:
        return
    yield first
    async for item in rest:
        yield item
