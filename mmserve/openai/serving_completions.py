"""`POST /v1/completions`: one prompt (text or token ids) → one response or an SSE stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from . import request_checks
from .input_processing import PreparedRequest
from .logprobs import completion_logprobs
from .metrics import RequestRecord
from .output_processing import ChoiceDelta, ChoiceResult, usage
from .protocol import CompletionChoice, CompletionChunk, CompletionLogProbs, CompletionRequest, CompletionResponse, UsageInfo
from .serving_common import ServingContext
from .sse import event_stream, sse, started
from .stream_chunks import DeltaChunks


class CompletionServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def completion(
        self, request: CompletionRequest, record: RequestRecord | None = None
    ) -> CompletionResponse | AsyncIterator[str | bytes]:
        context = self.context
        context.check_model(request.model)
        request_checks.check_completion_request(request)
        prompt = context.inputs.single_prompt(request)
        limits = await context.engine_limits()
        prompt_ids = await context.inputs.completion_prompt(prompt, limits)
        logprobs = request_checks.completion_logprobs(
            request, context.settings.limits.max_logprobs, context.inputs.tokenizer.vocab_size, limits.engine_kind
        )
        prepared = context.inputs.prepare(request, prompt_ids, request.max_tokens, "cmpl", limits, logprobs=logprobs)
        # The completions API shows every top entry of each token (see logprobs.completion_logprobs).
        prepared.top_logprobs = None if logprobs is None else -1
        prepared.attach(record)
        if request.stream:
            return await started(self._stream(request, prepared))
        with_ids = bool(request.return_token_ids)

        def choice(r: ChoiceResult) -> CompletionChoice:
            return CompletionChoice(
                index=r.index, text=r.text, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                token_ids=r.token_ids if with_ids else None,
                prompt_token_ids=prepared.prompt_token_ids if with_ids else None,
                logprobs=None if r.logprobs is None else CompletionLogProbs.model_validate(msgspec.to_builtins(completion_logprobs(r.logprobs, 0))),
            )

        return await context.outputs.full_response(prepared, CompletionResponse, choice, model=context.model_name)

    async def _stream(self, request: CompletionRequest, prepared: PreparedRequest) -> AsyncIterator[str | bytes]:
        with_ids = bool(request.return_token_ids)
        model = self.context.model_name
        sent_prompt_ids: set[int] = set()

        def chunk(choices: list[CompletionChoice], usage_info: UsageInfo | None = None) -> str:
            body = CompletionChunk(id=prepared.request_id, created=prepared.created, model=model, choices=choices, usage=usage_info)
            return sse(body.model_dump_json(exclude_none=True))

        chunks = DeltaChunks("text_completion", prepared.request_id, prepared.created, model)

        # Each choice's text offset for its next chunk's logprobs.
        text_offsets = [0] * prepared.n

        def delta_chunk(delta: ChoiceDelta) -> bytes:
            first = delta.index not in sent_prompt_ids
            sent_prompt_ids.add(delta.index)
            logprobs = None
            if delta.logprobs is not None:
                logprobs = completion_logprobs(delta.logprobs, text_offsets[delta.index])
                if logprobs.tokens:
                    text_offsets[delta.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            return chunks.completion(delta, with_ids, prepared.prompt_token_ids if (with_ids and first) else None, logprobs)

        deltas = self.context.outputs.deltas(prepared)
        async for event in event_stream(request, deltas, delta_chunk, lambda tokens: chunk([], usage_info=usage(prepared, tokens))):
            yield event
