"""`POST /v1/chat/completions`: messages (text and images) → one response or an SSE stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from mmserve.multimodal import ImageBatchRequest, PixelMode

from . import request_checks
from .input_processing import PreparedRequest
from .metrics import RequestRecord
from .output_processing import ChoiceDelta, ChoiceResult, usage
from .protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    DeltaMessage,
    ResponseMessage,
    UsageInfo,
)
from .serving_common import ServingContext, prompt_logprobs_response
from .sse import event_stream, sse, started
from .stream_chunks import DeltaChunks


class ChatServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def chat(
        self, request: ChatCompletionRequest, record: RequestRecord | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str | bytes]:
        context = self.context
        context.check_model(request.model)
        request_checks.check_chat_request(request)
        image_urls = context.inputs.take_image_urls(request)
        num_images = len(image_urls)
        limits = await context.engine_limits()
        prompt_ids = await context.inputs.chat_prompt(request, limits)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        logprobs = request_checks.chat_logprobs(
            request, context.settings.limits.max_logprobs, context.inputs.tokenizer.vocab_size, limits.engine_kind
        )
        prompt_logprobs = request_checks.prompt_logprobs(
            request, context.settings.limits.max_logprobs, context.inputs.tokenizer.vocab_size, limits.engine_kind
        )
        prepared = context.inputs.prepare(
            request, prompt_ids, max_tokens, "chatcmpl", limits, num_images=num_images,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
        prepared.attach(record, num_images=num_images)
        if image_urls:
            prepared.images = context.router.preprocess(
                ImageBatchRequest(
                    urls=image_urls, pixel_mode=PixelMode(context.settings.pixel_mode), engine_dtype=prepared.limits.dtype
                )
            )
        # The router holds the URLs until the preprocessor has them; this frame lives as long
        # as the response.
        del image_urls
        if request.stream:
            return await started(self._stream(request, prepared))
        with_ids = bool(request.return_token_ids)

        def choice(r: ChoiceResult) -> ChatCompletionChoice:
            return ChatCompletionChoice(
                index=r.index, message=ResponseMessage(content=r.text), finish_reason=r.finish_reason,
                stop_reason=r.stop_reason, token_ids=r.token_ids if with_ids else None,
                logprobs=None if r.logprobs is None else ChatCompletionLogProbs(content=[msgspec.to_builtins(t) for t in r.logprobs]),
            )

        return await context.outputs.full_response(
            prepared, ChatCompletionResponse, choice, model=context.model_name,
            extra=lambda results: {
                "prompt_token_ids": prepared.prompt_token_ids if with_ids else None,
                "prompt_logprobs": None if results[0].prompt_logprobs is None else prompt_logprobs_response(results[0].prompt_logprobs),
            },
        )

    async def _stream(self, request: ChatCompletionRequest, prepared: PreparedRequest) -> AsyncIterator[str | bytes]:
        with_ids = bool(request.return_token_ids)
        model = self.context.model_name

        def chunk(choices: list[ChatCompletionStreamChoice], usage_info: UsageInfo | None = None, first: bool = False) -> str:
            body = ChatCompletionChunk(
                id=prepared.request_id, created=prepared.created, model=model, choices=choices, usage=usage_info,
                prompt_token_ids=prepared.prompt_token_ids if (with_ids and first) else None,
            )
            return sse(body.model_dump_json(exclude_none=True))

        chunks = DeltaChunks("chat.completion.chunk", prepared.request_id, prepared.created, model)

        def delta_chunk(delta: ChoiceDelta) -> bytes:
            return chunks.chat(delta, with_ids)

        # First chunk of every choice announces the role, as OpenAI and vLLM do.
        def opening() -> str:
            return chunk(
                [ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(prepared.n)],
                first=True,
            )

        deltas = self.context.outputs.deltas(prepared)
        async for event in event_stream(
            request, deltas, delta_chunk, lambda tokens: chunk([], usage_info=usage(prepared, tokens)), opening
        ):
            yield event
