"""Output processing: engine outputs → per-choice text deltas (detokenized, stop strings, finish reasons), usage, full responses.

The engine neither detokenizes nor matches stop strings; this does, per choice, exactly as
vLLM's output processor (`mmserve.text`). Errors from below leave as `OpenAIError`s (the one
table in `errors.py`). The non-streaming response of every endpoint is built here, once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from mmserve.transit.engine_link import EngineEvent
from mmserve.text import IncrementalDetokenizer, SequenceText, Tokenizer
from mmserve.wire import EngineCoreOutput, EngineCoreRequest, FinishReason

from .errors import OpenAIError, openai_error
from .input_processing import PreparedRequest
from .logprobs import ChoiceLogprobs, PromptLogprobs, PromptLogprobsCollector, TokenLogprob, TokenStrings
from .metrics import Metrics
from .parallel_sampling import child_request, interleave
from .protocol import UsageInfo

Response = TypeVar("Response")
Choice = TypeVar("Choice")


class EngineStreams(Protocol):
    """Where engine requests go (the engine router)."""

    def generate(self, request: EngineCoreRequest, images: object | None = None) -> AsyncIterator[EngineEvent]: ...


@dataclass
class ChoiceDelta:
    """New output of one choice since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # One entry per new token when the request asked for logprobs, else None.
    logprobs: list[TokenLogprob] | None = None
    # The whole prompt's logprobs, when asked for, in the choice's first delta with tokens (or its
    # last): the engine has sent them all by the time it samples the first token.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class ChoiceResult:
    """One choice's whole output."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None


def usage(prepared: PreparedRequest, completion_tokens: int) -> UsageInfo:
    prompt_tokens = len(prepared.prompt_token_ids)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


class OutputProcessor:
    """Turns a prepared request's engine streams into choices, recording timings as they come."""

    def __init__(self, tokenizer: Tokenizer, engines: EngineStreams, metrics: Metrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.token_strings = TokenStrings(tokenizer)
        self.engines = engines
        self.metrics = metrics

    async def deltas(self, prepared: PreparedRequest) -> AsyncIterator[ChoiceDelta]:
        """All choices' deltas, interleaved as they arrive, with their timings recorded."""
        record = prepared.record
        async for delta in interleave(prepared.n, lambda index: self._choice_deltas(prepared, index)):
            now = time.monotonic()
            if delta.token_ids:
                if record.first_token_at is None:
                    record.first_token_at = now
                elif self.metrics is not None and record.last_token_at is not None:
                    self.metrics.observe_token_gap(now - record.last_token_at)
                record.last_token_at = now
                record.completion_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                record.finish_reasons.append(delta.finish_reason)
            yield delta

    async def full_response(
        self,
        prepared: PreparedRequest,
        response_type: Callable[..., Response],
        choice: Callable[[ChoiceResult], Any],
        *,
        model: str,
        extra: Callable[[list[ChoiceResult]], dict[str, Any]] = lambda results: {},
    ) -> Response:
        """The non-streaming response of any endpoint: every choice collected, then usage.
        `extra(results)` is read after the engine has answered (the prompt may have grown by images)."""
        results = [ChoiceResult(i) for i in range(prepared.n)]
        async for delta in self.deltas(prepared):
            result = results[delta.index]
            result.text += delta.text
            result.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                if result.logprobs is None:
                    result.logprobs = []
                result.logprobs.extend(delta.logprobs)
            if delta.prompt_logprobs is not None:
                result.prompt_logprobs = delta.prompt_logprobs
            if delta.finish_reason is not None:
                result.finish_reason, result.stop_reason = delta.finish_reason, delta.stop_reason
        return response_type(
            id=prepared.request_id,
            created=prepared.created,
            model=model,
            choices=[choice(r) for r in results],
            usage=usage(prepared, sum(len(r.token_ids) for r in results)),
            **extra(results),
        )

    async def _choice_deltas(self, prepared: PreparedRequest, index: int) -> AsyncIterator[ChoiceDelta]:
        """Stream one choice: engine tokens → text deltas, stop strings, finish reasons."""
        seq: SequenceText | None = None
        emitted_ids = 0
        choice_logprobs = None if prepared.top_logprobs is None else ChoiceLogprobs(self.token_strings, prepared.top_logprobs)
        prompt_logprobs = None if prepared.sampling.prompt_logprobs is None else PromptLogprobsCollector(self.token_strings)
        engine_request = child_request(
            prepared.request_id, prepared.prompt_token_ids, prepared.sampling, prepared.n, index,
            prepared.record.arrival_time, prepared.reasoning_ended, prepared.reasoning_parser_kwargs,
        )
        engine_stream = self.engines.generate(engine_request, prepared.images)
        try:
            async for event in engine_stream:
                if (accepted := event.accepted) is not None:
                    # Image placeholders expanded by the engine client: the prompt as the engine has it.
                    prepared.prompt_token_ids = accepted.prompt_token_ids
                    prepared.record.prompt_tokens = len(accepted.prompt_token_ids)
                    prepared.record.preprocess_ms = accepted.preprocess_ms
                    prepared.images_delivered()
                    continue
                if seq is None:
                    seq = self._sequence_text(prepared)
                # Every output that arrived since the last delta makes one delta (vLLM's collector
                # merges the same way while its consumer lags); stop strings are still checked
                # per engine step.
                finish_reason, stop_reason = None, None
                logprobs: list[TokenLogprob] | None = None if choice_logprobs is None else []
                for output in event.outputs:
                    finish = output.finish_reason
                    if finish is FinishReason.ERROR:
                        raise OpenAIError("the engine failed to process the request", status=500)
                    if prompt_logprobs is not None and output.new_prompt_logprobs_tensors is not None:
                        prompt_logprobs.add(output.new_prompt_logprobs_tensors)
                    num_before = len(seq.token_ids)
                    stop_string = seq.update(output.new_token_ids, stop_terminated=finish is FinishReason.STOP)
                    if logprobs is not None:
                        logprobs += _rendered_logprobs(choice_logprobs, output, len(seq.token_ids) - num_before)
                    if stop_string is not None:
                        finish_reason, stop_reason = "stop", stop_string
                        break
                    if finish is not None:
                        finish_reason, stop_reason = finish.openai_name, output.stop_reason
                        break
                text = seq.next_delta(finished=finish_reason is not None)
                new_ids = seq.token_ids[emitted_ids:]
                emitted_ids = len(seq.token_ids)
                prompt_positions = None
                if prompt_logprobs is not None and (new_ids or finish_reason is not None):
                    prompt_positions, prompt_logprobs = prompt_logprobs.positions, None
                yield ChoiceDelta(index, text, new_ids, finish_reason, stop_reason, logprobs, prompt_positions)
                if finish_reason is not None:
                    return
            raise OpenAIError("the engine stream ended without finishing the request", status=500)
        except Exception as exc:
            error = openai_error(exc)
            if error is None or error is exc:
                raise
            raise error from None
        finally:
            # Closing the engine stream early aborts the request in the engine.
            await engine_stream.aclose()

    def _sequence_text(self, prepared: PreparedRequest) -> SequenceText:
        detok = IncrementalDetokenizer(
            self.tokenizer,
            prepared.prompt_token_ids,
            skip_special_tokens=prepared.skip_special_tokens,
            spaces_between_special_tokens=prepared.spaces_between_special_tokens,
        )
        return SequenceText(
            detok,
            stop=prepared.stop,
            include_stop_str_in_output=prepared.include_stop_str_in_output,
            min_tokens=prepared.min_tokens,
        )


def _rendered_logprobs(choice: ChoiceLogprobs, output: EngineCoreOutput, num_kept: int) -> list[TokenLogprob]:
    if not num_kept:
        return []
    if output.new_logprobs is None:
        raise OpenAIError("the engine sent no logprobs for a request that asked for them", status=500)
    return choice.render(output.new_logprobs, num_kept)
