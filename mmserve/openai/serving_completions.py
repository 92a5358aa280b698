"""`POST /v1/completions`: one prompt (text or token ids) → one response or an SSE stream."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import msgspec

from . import request_checks
from .errors import OpenAIError
from .input_processing import PreparedRequest
from .logprobs import CompletionToken, PromptLogprobs, completion_logprobs, completion_tokens, echoed_prompt_tokens
from .metrics import RequestRecord
from .output_processing import ChoiceDelta, ChoiceResult, usage
from .protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from .serving_common import ServingContext, prompt_logprobs_response
from .sse import event_stream, sse, started
from .stream_chunks import DeltaChunks
from .structured_outputs import structured_outputs


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
        max_logprobs, vocab_size = context.settings.limits.max_logprobs, context.inputs.tokenizer.vocab_size
        request_checks.check_engine_can_honour(request, limits.engine_kind)
        logprobs = request_checks.completion_logprobs(request, max_logprobs, vocab_size, limits.engine_kind)
        prompt_logprobs = request_checks.prompt_logprobs(request, max_logprobs, vocab_size, limits.engine_kind)
        if request.echo and prompt_logprobs is None:
            prompt_logprobs = logprobs  # vLLM's default: an echoed prompt shows logprobs as the answer does
        # `echo` with max_tokens=0 answers the prompt alone; the engine still makes one token, as vLLM's does.
        echo_only = bool(request.echo) and request.max_tokens == 0
        # The completions API shows every top entry of each token (see logprobs.completion_tokens).
        structured = await context.inputs.off_loop(structured_outputs, request) if request.has_structured_outputs else None
        prepared = context.inputs.prepare(
            request, prompt_ids, 1 if echo_only else request.max_tokens, "cmpl", limits, structured,
            logprobs=logprobs, shown_logprobs=-1, prompt_logprobs=prompt_logprobs,
        )
        prepared.attach(record)
        echo = _Echo(self, request, prompt, prepared, echo_only) if request.echo else None
        if request.stream:
            return await started(self._stream(request, prepared, echo))
        with_ids = bool(request.return_token_ids)

        def choice(r: ChoiceResult) -> CompletionChoice:
            tokens = None if r.logprobs is None else completion_tokens(r.logprobs)
            text = r.text
            if echo is not None:
                text, tokens = echo.prepended(text, tokens, r.prompt_logprobs)
            return CompletionChoice(
                index=r.index, text=text, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                token_ids=r.token_ids if with_ids else None,
                prompt_token_ids=prepared.prompt_token_ids if with_ids else None,
                logprobs=None if tokens is None else CompletionLogProbs.model_validate(msgspec.to_builtins(completion_logprobs(tokens, 0))),
                prompt_logprobs=None if r.prompt_logprobs is None else prompt_logprobs_response(r.prompt_logprobs),
            )

        return await context.outputs.full_response(prepared, CompletionResponse, choice, model=context.model_name)

    async def _stream(self, request: CompletionRequest, prepared: PreparedRequest, echo: _Echo | None) -> AsyncIterator[str | bytes]:
        with_ids = bool(request.return_token_ids)
        model = self.context.model_name
        started_choices: set[int] = set()

        def chunk(choices: list[CompletionChoice], usage_info: UsageInfo | None = None) -> str:
            body = CompletionChunk(id=prepared.request_id, created=prepared.created, model=model, choices=choices, usage=usage_info)
            return sse(body.model_dump_json(exclude_none=True))

        chunks = DeltaChunks("text_completion", prepared.request_id, prepared.created, model)

        # Each choice's text offset for its next chunk's logprobs.
        text_offsets = [0] * prepared.n

        def delta_chunk(delta: ChoiceDelta) -> bytes:
            # A choice's first chunk carries the prompt's ids when asked for, and the echoed prompt.
            first = delta.index not in started_choices
            started_choices.add(delta.index)
            tokens = None if delta.logprobs is None else completion_tokens(delta.logprobs)
            if echo is not None and first:
                text, tokens = echo.prepended(delta.text, tokens, delta.prompt_logprobs)
                delta = dataclasses.replace(delta, text=text)
            logprobs = None
            if tokens is not None:
                logprobs = completion_logprobs(tokens, text_offsets[delta.index])
                if logprobs.tokens:
                    text_offsets[delta.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            return chunks.completion(delta, with_ids, prepared.prompt_token_ids if (with_ids and first) else None, logprobs)

        deltas = self.context.outputs.deltas(prepared)
        async for event in event_stream(request, deltas, delta_chunk, lambda tokens: chunk([], usage_info=usage(prepared, tokens))):
            yield event


class _Echo:
    """What `echo` puts before each choice's answer: the prompt's text (none with `return_token_ids`,
    as vLLM) and, with `logprobs`, its tokens; with max_tokens=0 (`only`), in place of the answer."""

    def __init__(
        self, serving: CompletionServing, request: CompletionRequest, prompt: str | list[int], prepared: PreparedRequest, only: bool
    ) -> None:
        self.only = only
        strings = serving.context.outputs.token_strings
        if request.return_token_ids:
            self.text = ""
        else:
            # vLLM's renderer decodes a token prompt with the tokenizer's defaults (special tokens kept).
            self.text = prompt if isinstance(prompt, str) else strings.decode(prepared.prompt_token_ids)
        self._strings = strings
        self._prompt_ids = prepared.prompt_token_ids
        self._num_shown = -1 if request.logprobs is None else request.logprobs

    def prepended(
        self, text: str, tokens: list[CompletionToken] | None, positions: PromptLogprobs | None
    ) -> tuple[str, list[CompletionToken] | None]:
        """A choice's (first) text and logprob tokens with the prompt's before them (or instead)."""
        if self.only:
            text, tokens = "", None if tokens is None else []
        return self.text + text, None if tokens is None else self.tokens(positions) + tokens

    def tokens(self, positions: PromptLogprobs | None) -> list[CompletionToken]:
        if positions is None:
            # Asked for with the logprobs (vLLM's default for echo), they come with the choice's first tokens.
            raise OpenAIError("the engine sent no prompt logprobs for a request that asked for them", status=500)
        return echoed_prompt_tokens(self._prompt_ids, positions, self._num_shown, self._strings)
