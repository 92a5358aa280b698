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
    CompletionTokenUsageInfo,
    DeltaMessage,
    FunctionCall,
    ResponseMessage,
    ToolCall,
    UsageInfo,
)
from .serving_common import ServingContext, prompt_logprobs_response
from .sse import event_stream, sse, started
from .choice_output import ChoiceOutput
from .output_parsing import OutputParsing, output_parsing, reasoning_ended
from .stream_chunks import DeltaChunks
from .structured_outputs import structured_outputs
from .tool_calls import engine_tool_constraints, tool_call_plan


class ChatServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def chat(
        self, request: ChatCompletionRequest, record: RequestRecord | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str | bytes]:
        context = self.context
        context.check_model(request.model)
        tool_choice = request_checks.check_chat_request(request, context.settings.tool_calls)
        tool_plan = tool_call_plan(request, tool_choice, context.settings.tool_calls)
        image_urls = context.inputs.take_image_urls(request)
        num_images = len(image_urls)
        limits = await context.engine_limits()
        prompt_ids = await context.inputs.chat_prompt(request, limits)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        request_checks.check_engine_can_honour(request, limits.engine_kind)
        logprobs = request_checks.chat_logprobs(
            request, context.settings.limits.max_logprobs, context.inputs.tokenizer.vocab_size, limits.engine_kind
        )
        prompt_logprobs = request_checks.prompt_logprobs(
            request, context.settings.limits.max_logprobs, context.inputs.tokenizer.vocab_size, limits.engine_kind
        )
        structured = await context.inputs.off_loop(structured_outputs, request) if request.has_structured_outputs else None
        prepared = context.inputs.prepare(
            request, prompt_ids, max_tokens, "chatcmpl", limits, structured, num_images=num_images,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
        changed = None
        if tool_plan is not None and tool_plan.mode in ("none", "null"):  # nothing to compile: no thread hop
            changed = engine_tool_constraints(request, tool_plan, structured)
        elif tool_plan is not None:
            changed = await context.inputs.off_loop(engine_tool_constraints, request, tool_plan, structured)
        if changed:
            prepared.skip_special_tokens = prepared.sampling.skip_special_tokens = changed[0]
            prepared.sampling.structured_outputs = changed[1]
        parsing = output_parsing(request, tool_plan, context.reasoning, prompt_ids)
        prepared.reasoning_ended = reasoning_ended(request, parsing)
        if parsing is not None and parsing.reasoning is not None:
            prepared.reasoning_parser_kwargs = {"chat_template_kwargs": parsing.reasoning_kwargs}
            if parsing.reasoning.engine_based:  # vLLM's parser-engine `adjust_request`
                prepared.skip_special_tokens = prepared.sampling.skip_special_tokens = False
        prepared.attach(record, num_images=num_images)
        if image_urls:
            prepared.images = context.router.preprocess(
                ImageBatchRequest(
                    urls=image_urls, pixel_mode=PixelMode(context.settings.pixel_mode), engine_dtype=prepared.limits.dtype
                ),
                group=prepared.request_id if prepared.n > 1 else "", choices=prepared.n,
            )
        # The router holds the URLs until the preprocessor has them; this frame lives as long
        # as the response.
        del image_urls
        if request.stream:
            return await started(self._stream(request, prepared, parsing))
        with_ids = bool(request.return_token_ids)
        reasoning_tokens = 0

        def choice(r: ChoiceResult) -> ChatCompletionChoice:
            nonlocal reasoning_tokens
            message, finish_reason, metadata = ResponseMessage(content=r.text), r.finish_reason, True
            if parsing is not None:
                reader = ChoiceOutput(parsing)
                answer = reader.whole(r.text, r.finish_reason)
                message = ResponseMessage(content=answer.content, reasoning=answer.reasoning, tool_calls=None if answer.tool_calls is None else [
                    ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments)) for call in answer.tool_calls
                ])  # fmt: skip
                finish_reason, metadata = answer.finish_reason, reader.shows_metadata
                reasoning_tokens += reader.reasoning_tokens(r.token_ids)
            return ChatCompletionChoice(
                index=r.index, message=message, finish_reason=finish_reason,
                stop_reason=r.stop_reason, token_ids=r.token_ids if with_ids and metadata else None,
                logprobs=None if r.logprobs is None or not metadata else ChatCompletionLogProbs(
                    content=[msgspec.to_builtins(t) for t in r.logprobs]
                ),
            )

        response = await context.outputs.full_response(
            prepared, ChatCompletionResponse, choice, model=context.model_name,
            extra=lambda results: {
                "prompt_token_ids": prepared.prompt_token_ids if with_ids else None,
                "prompt_logprobs": None if results[0].prompt_logprobs is None else prompt_logprobs_response(results[0].prompt_logprobs),
            },
        )
        if context.reasoning is not None:  # vLLM counts them whenever a reasoning parser is on
            response.usage.completion_tokens_details = CompletionTokenUsageInfo(reasoning_tokens=reasoning_tokens)
        return response

    async def _stream(
        self, request: ChatCompletionRequest, prepared: PreparedRequest, parsing: OutputParsing | None
    ) -> AsyncIterator[str | bytes]:
        with_ids = bool(request.return_token_ids)
        model = self.context.model_name

        def chunk(choices: list[ChatCompletionStreamChoice], usage_info: UsageInfo | None = None, first: bool = False) -> str:
            body = ChatCompletionChunk(
                id=prepared.request_id, created=prepared.created, model=model, choices=choices, usage=usage_info,
                prompt_token_ids=prepared.prompt_token_ids if (with_ids and first) else None,
            )
            return sse(body.model_dump_json(exclude_none=True))

        chunks = DeltaChunks("chat.completion.chunk", prepared.request_id, prepared.created, model)

        # With a parser, one reader per choice (it keeps state).
        readers = None if parsing is None else [ChoiceOutput(parsing) for _ in range(prepared.n)]

        def delta_chunk(delta: ChoiceDelta) -> bytes | None:
            if readers is None:
                return chunks.chat(delta, with_ids)
            return _parsed_chunk(chunks, readers[delta.index], delta, with_ids)

        # First chunk of every choice announces the role, as OpenAI and vLLM do.
        def opening() -> str:
            return chunk(
                [ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(prepared.n)],
                first=True,
            )

        deltas = self.context.outputs.deltas(prepared)
        generated: list[list[int]] = [[] for _ in range(prepared.n)]
        counts_reasoning = readers is not None and self.context.reasoning is not None
        if counts_reasoning:  # every token, also of deltas no chunk is sent for
            deltas = _recording_ids(deltas, generated)

        def usage_chunk(tokens: int) -> str:
            usage_info = usage(prepared, tokens)
            if counts_reasoning:
                assert readers is not None
                usage_info.completion_tokens_details = CompletionTokenUsageInfo(
                    reasoning_tokens=sum(reader.reasoning_tokens(ids) for reader, ids in zip(readers, generated))
                )
            return chunk([], usage_info=usage_info)

        async for event in event_stream(request, deltas, delta_chunk, usage_chunk, opening):
            yield event


async def _recording_ids(deltas: AsyncIterator[ChoiceDelta], generated: list[list[int]]) -> AsyncIterator[ChoiceDelta]:
    async for delta in deltas:
        generated[delta.index].extend(delta.token_ids)
        yield delta


def _parsed_chunk(chunks: DeltaChunks, reader: ChoiceOutput, delta: ChoiceDelta, with_ids: bool) -> bytes | None:
    """A delta read by the choice's parsers as a chunk, or None where vLLM sends none: the parsers have
    nothing yet and the delta neither finishes the choice nor carries shown logprobs or ids."""
    message = reader.delta(delta.text, delta.token_ids, finished=delta.finish_reason is not None)
    metadata = reader.shows_metadata
    if message is None and delta.finish_reason is None and not (metadata and (delta.logprobs or (with_ids and delta.token_ids))):
        return None
    finish_reason = None if delta.finish_reason is None else reader.stream_finish_reason(delta.finish_reason)
    return chunks.chat_parsed(delta, message, finish_reason, with_ids, metadata)
