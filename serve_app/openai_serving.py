"""OpenAI chat and text completions over engine clients: a plain class, testable without Ray.

Per request: validate → render the chat template → tokenize → check the context → build
the engine's SamplingParams exactly as vLLM's front-end would (generation-config defaults,
EOS and stop ids) → one engine request per choice (`n` children, ids `{i}_{parent}`, seeds
`seed + i`, as vLLM's parallel sampling does) → incremental detokenization and stop strings
here (the engine does neither) → OpenAI responses or SSE chunks. Leaving a stream early
(stop string, client gone) closes the engine stream, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from jinja2 import TemplateError

from mmserve.engine import EngineDeadError, EngineError, EngineNotReadyError, EngineOverloadedError, InvalidRequestError
from mmserve.protocol import EngineEvent, GatewayBusyError
from mmserve.multimodal import ImageBatchRequest, PixelMode, load_image_family
from mmserve.vision import resize_path
from mmserve.multimodal.errors import ImageInputError
from mmserve.text import (
    ConversationMessage as TextChatMessage,
    IncrementalDetokenizer,
    MediaContent as MediaPart,
    ModelFiles,
    SequenceText,
    TextContent as TextContentPart,
    Tokenizer,
    load_chat_template,
    resolve_stop_token_ids,
)
from mmserve.wire import EngineCoreRequest, FinishReason, SamplingParams, StructuredOutputsParams

from . import validation
from .config import AppConfig
from .errors import OpenAIError, bad_request
from .intake import text_chars
from .observability import Metrics, RequestRecord
from .schemas import (
    ChatMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    GatewayInfo,
    ModelCard,
    ModelList,
    ResponseMessage,
    SamplingRequestFields,
    UsageInfo,
)

logger = logging.getLogger("ray.serve")

# Prompts with at least this many characters of text are templated and tokenized off the
# event loop (≈1 µs per character: 32 k characters block the loop for ≈30 ms).
PROMPT_INLINE_CHARS = 32 * 1024
# Worker threads for long prompts, per ingress replica; more would only compete for the cores.
PROMPT_THREADS = 2


@dataclass(frozen=True)
class EngineLimits:
    """What the serving layer needs from the engines' handshake."""

    max_model_len: int
    engine_kind: str  # "vllm" or "mmserve-builtin"
    dtype: str = "bfloat16"


class EngineRouter(Protocol):
    """Chooses an engine and streams a request's outputs from it."""

    async def limits(self, wait: bool = True) -> EngineLimits: ...

    def generate(
        self, request: EngineCoreRequest, images: object | None = None
    ) -> AsyncIterator[EngineEvent]: ...

    def preprocess(self, request: ImageBatchRequest) -> object:
        """Start preprocessing; returns an opaque handle to pass to `generate` (never awaited here)."""
        ...


@dataclass
class ChoiceDelta:
    """New output of one choice since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class PreparedRequest:
    """A validated request, ready to become engine requests."""

    request_id: str
    created: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    n: int
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    min_tokens: int
    # The engines' limits this request was checked against (from their handshake).
    limits: EngineLimits
    # Opaque preprocessing response (never resolved in the ingress), or None for text only.
    images: object | None = None
    # Timings and counts for metrics and the request's log line.
    record: RequestRecord = field(default_factory=lambda: RequestRecord("unknown"))


class OpenAIServer:
    def __init__(self, config: AppConfig, router: EngineRouter, metrics: Metrics | None = None) -> None:
        self.config = config
        self.router = router
        self.metrics = metrics
        self.model_files = ModelFiles.load(config.model_dir)
        self.tokenizer = Tokenizer.from_model_files(self.model_files)
        self.image_family = load_image_family(config.model_dir)
        placeholders = self.image_family.chat_placeholders if self.image_family else None
        self.chat_template = load_chat_template(self.model_files, placeholders) if placeholders else load_chat_template(self.model_files)
        self.model_name = config.model_name
        # Upper bound of the characters one token covers (byte-level BPE vocab strings have one
        # character per byte; SentencePiece's have one per character).
        self.longest_token_chars = max(len(t) for t in self.tokenizer.backend.get_vocab(with_added_tokens=True))
        self._prompt_pool = ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="mmserve-prompt")
        if metrics is not None and self.image_family is not None:
            metrics.set_resize_path(resize_path())

    # ------------------------------------------------------------------ endpoints

    async def models(self) -> ModelList:
        try:
            # Never wait for an engine here: listing models must answer while engines are down.
            limits = await self.router.limits(wait=False)
            max_len, engine = limits.max_model_len, limits.engine_kind
        except EngineError:
            max_len, engine = None, None
        card = ModelCard(id=self.model_name, root=str(self.config.model_dir), max_model_len=max_len, engine=engine)
        if self.image_family is not None:
            # The preprocessor replicas run from this same environment, so they resize the same way.
            card.mmserve = GatewayInfo(image_resize=resize_path())
        return ModelList(data=[card])

    async def chat(
        self, request: ChatCompletionRequest, record: RequestRecord | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        self._check_model(request.model)
        validation.check_chat_request(request)
        if len(request.messages) > self.config.limits.max_messages:  # also checked while decoding (intake.py)
            raise bad_request(f"at most {self.config.limits.max_messages} messages are allowed (limits.max_messages)", "messages")
        image_urls = self._image_urls(request)
        limits = await self._engine_limits()
        chars = sum(text_chars(m.content) for m in request.messages)
        self._check_prompt_chars(chars, limits, "messages")
        text_messages = [_to_text_message(m) for m in request.messages]

        def render_and_tokenize() -> list[int]:
            try:
                prompt_text = self.chat_template.render(
                    text_messages,
                    add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message,
                )
            except (ValueError, TemplateError) as exc:
                raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
            # vLLM's chat path tokenizes the rendered template without adding special tokens.
            # Each image is ONE placeholder token here; the engine client expands it once the
            # preprocessor has measured the image, so tokenization never waits for pixels.
            return self._encode(prompt_text, add_special_tokens=False)

        prompt_ids = await self._prompt_work(render_and_tokenize, chars)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        prepared = await self._prepare(
            request, prompt_ids, max_tokens, "chatcmpl", self._structured_outputs(request), limits, num_images=len(image_urls)
        )
        self._attach(prepared, record, num_images=len(image_urls))
        if image_urls:
            prepared.images = self.router.preprocess(
                ImageBatchRequest(
                    urls=image_urls, pixel_mode=PixelMode(self.config.images.pixel_mode), engine_dtype=prepared.limits.dtype
                )
            )
        if request.stream:
            return await self._started(self._chat_stream(request, prepared))
        return await self._chat_full(request, prepared)

    def _image_urls(self, request: ChatCompletionRequest) -> list[str]:
        """Image URLs in prompt order, checked for count and scheme before any work is started."""
        urls = [
            part.image_url.url
            for message in request.messages
            if isinstance(message.content, list)
            for part in message.content
            if part.type == "image_url"
        ]
        if not urls:
            return urls
        if self.image_family is None:
            raise bad_request(f"the model {self.model_name} does not take image inputs", "messages")
        limit = self.config.images.max_images_per_request
        if len(urls) > limit:
            raise bad_request(f"{len(urls)} images in one request; at most {limit} are allowed", "messages")
        for url in urls:
            scheme = url.split(":", 1)[0].lower() if ":" in url else ""
            if scheme not in ("data", "http", "https", "file"):
                raise bad_request(f"unsupported image URL scheme {scheme or url[:16]!r}", "messages")
        return urls

    @staticmethod
    async def _started(stream: AsyncIterator[str]) -> AsyncIterator[str]:
        """Run a response stream up to its first chunk before answering, so that errors found
        on the way (bad images, no engine, admission) get their HTTP status instead of a 200."""
        first = await anext(stream)

        async def chained() -> AsyncIterator[str]:
            yield first
            async for chunk in stream:
                yield chunk

        return chained()

    async def completion(
        self, request: CompletionRequest, record: RequestRecord | None = None
    ) -> CompletionResponse | AsyncIterator[str]:
        self._check_model(request.model)
        validation.check_completion_request(request)
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) != 1 and not (prompt and isinstance(prompt[0], int)):
            raise bad_request("batched prompts are not supported; send one prompt per request", "prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a one-element batch
        limits = await self._engine_limits()
        if isinstance(prompt, str):
            self._check_prompt_chars(len(prompt), limits, "prompt")
            text = prompt
            prompt_ids = await self._prompt_work(lambda: self._encode(text, add_special_tokens=True), len(text))
        else:
            prompt_ids = list(prompt)
            if len(prompt_ids) >= limits.max_model_len:
                self._context_exceeded(limits.max_model_len, len(prompt_ids), "prompt")
            validation.check_token_ids(prompt_ids, self.tokenizer.max_token_id, "prompt")
        if not prompt_ids:
            raise bad_request("the prompt is empty", "prompt")
        prepared = await self._prepare(request, prompt_ids, request.max_tokens, "cmpl", self._structured_outputs(request), limits)
        self._attach(prepared, record)
        if request.stream:
            return await self._started(self._completion_stream(request, prepared))
        return await self._completion_full(request, prepared)

    # ------------------------------------------------------------------ preparation

    @staticmethod
    def _attach(prepared: PreparedRequest, record: RequestRecord | None, num_images: int = 0) -> None:
        if record is not None:
            prepared.record = record
        prepared.record.request_id = prepared.request_id
        prepared.record.prompt_tokens = len(prepared.prompt_token_ids)
        prepared.record.num_images = num_images

    async def _engine_limits(self) -> EngineLimits:
        try:
            return await self.router.limits()
        except EngineNotReadyError as exc:
            raise OpenAIError(f"no engine is ready: {exc}", status=503, retry_after_s=5) from None
        except EngineError as exc:
            raise OpenAIError(f"no engine is available: {exc}", status=503, retry_after_s=5) from None

    @staticmethod
    def _context_exceeded(max_model_len: int, prompt_len: int, param: str) -> None:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains {prompt_len} input tokens, which leaves no room for any output tokens. "
            "Please reduce the length of the input prompt.",
            param,
            "context_length_exceeded",
        )

    def max_prompt_chars(self, limits: EngineLimits) -> int:
        """More characters than this cannot fit the context: every token covers at most
        `longest_token_chars` of them (see `limits.max_prompt_chars`)."""
        configured = self.config.limits.max_prompt_chars
        if configured is not None:
            return configured
        max_tokens = min(limits.max_model_len, self.config.limits.max_prompt_tokens or limits.max_model_len)
        return max_tokens * self.longest_token_chars

    def _check_prompt_chars(self, chars: int, limits: EngineLimits, param: str) -> None:
        """Refuse a prompt by its length in characters, before templating and tokenizing it."""
        limit = self.max_prompt_chars(limits)
        if chars > limit:
            raise bad_request(
                f"This model's maximum context length is {limits.max_model_len} tokens. However, your prompt "
                f"has {chars} characters of text, more than can fit in that context ({limit}). "
                "Please reduce the length of the input prompt.",
                param,
                "context_length_exceeded",
            )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): other requests on
        # the event loop keep running while a long prompt is tokenized in a worker thread.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    async def _prompt_work(self, work: Callable[[], list[int]], chars: int) -> list[int]:
        """Template rendering and tokenization: inline for short prompts (a thread hop costs
        more than the work), in the bounded prompt pool for long ones."""
        if chars < PROMPT_INLINE_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, work)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                status=400, param="model", code="model_not_found",
            )

    def _structured_outputs(self, request: SamplingRequestFields) -> StructuredOutputsParams | None:
        """`structured_outputs` and `response_format`, checked as vLLM's front-end would."""
        return validation.structured_outputs(request)

    async def _prepare(
        self,
        request: SamplingRequestFields,
        prompt_ids: list[int],
        max_tokens: int | None,
        id_prefix: str,
        structured: StructuredOutputsParams | None,
        limits: EngineLimits,
        num_images: int = 0,
    ) -> PreparedRequest:
        max_model_len = limits.max_model_len
        prompt_len = len(prompt_ids)
        max_prompt = self.config.limits.max_prompt_tokens or max_model_len
        if prompt_len >= min(max_model_len, max_prompt + 1):
            self._context_exceeded(max_model_len, prompt_len, "messages" if id_prefix == "chatcmpl" else "prompt")
        defaults = self.model_files.generation_config.sampling_defaults
        # With images the final prompt length is known only after preprocessing: the engine
        # client completes these checks (and the max_tokens default) for image requests.
        resolved_max_tokens = max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
            if defaults.max_tokens is not None:
                max_tokens = resolved_max_tokens = min(max_tokens, defaults.max_tokens)
            elif not num_images:
                resolved_max_tokens = max_tokens
        elif prompt_len + max_tokens > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                "max_tokens",
                "context_length_exceeded",
            )
        validation.check_sampling(request, max_tokens, self.config.limits, self.tokenizer.max_token_id)

        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        stop_ids = resolve_stop_token_ids(
            tokenizer_eos_token_id=self.tokenizer.eos_token_id,
            generation_eos_token_ids=self.model_files.generation_config.eos_token_ids,
            request_stop_token_ids=list(dict.fromkeys(request.stop_token_ids or [])),
            ignore_eos=request.ignore_eos,
        )

        def pick(value, default, fallback):
            return value if value is not None else (default if default is not None else fallback)

        sampling = SamplingParams(
            n=1,
            temperature=pick(request.temperature, defaults.temperature, 1.0),
            top_p=pick(request.top_p, defaults.top_p, 1.0),
            top_k=pick(request.top_k, defaults.top_k, 0),
            min_p=pick(request.min_p, defaults.min_p, 0.0),
            presence_penalty=pick(request.presence_penalty, defaults.presence_penalty, 0.0),
            frequency_penalty=pick(request.frequency_penalty, defaults.frequency_penalty, 0.0),
            repetition_penalty=pick(request.repetition_penalty, defaults.repetition_penalty, 1.0),
            seed=request.seed,
            stop=stop or None,
            stop_token_ids=stop_ids.stop_token_ids or None,
            ignore_eos=request.ignore_eos,
            max_tokens=resolved_max_tokens,
            min_tokens=request.min_tokens,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            structured_outputs=structured,
            logit_bias={int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None,
            allowed_token_ids=list(request.allowed_token_ids) if request.allowed_token_ids else None,
            bad_words=list(dict.fromkeys(request.bad_words)) if request.bad_words else None,
            _bad_words_token_ids=validation.bad_words_token_ids(
                request.bad_words or [], lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                self.tokenizer.max_token_id,
            ),
            _eos_token_id=stop_ids.eos_token_id,
            _all_stop_token_ids=set(stop_ids.all_stop_token_ids),
        )
        if sampling.temperature < 1e-5:
            # vLLM's greedy normalisation (SamplingParams.__post_init__).
            sampling.top_p, sampling.top_k, sampling.min_p = 1.0, 0, 0.0
        return PreparedRequest(
            request_id=f"{id_prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            n=request.n,
            stop=stop,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            min_tokens=request.min_tokens,
            limits=limits,
        )

    def _engine_request(self, prepared: PreparedRequest, index: int) -> EngineCoreRequest:
        sampling = prepared.sampling
        request_id = prepared.request_id
        if prepared.n > 1:
            request_id = f"{index}_{request_id}"
            if sampling.seed is not None:
                sampling = _with_seed(sampling, sampling.seed + index)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            mm_features=None,
            sampling_params=sampling,
            pooling_params=None,
            arrival_time=prepared.record.arrival_time,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )

    # ------------------------------------------------------------------ generation

    async def _choice_deltas(self, prepared: PreparedRequest, index: int) -> AsyncIterator[ChoiceDelta]:
        """Stream one choice: engine tokens → text deltas, stop strings, finish reasons."""
        seq: SequenceText | None = None
        emitted_ids = 0
        engine_stream = self.router.generate(self._engine_request(prepared, index), prepared.images)
        try:
            async for event in engine_stream:
                if (accepted := event.accepted) is not None:
                    # Image placeholders expanded by the engine client: the prompt as the engine has it.
                    prepared.prompt_token_ids = accepted.prompt_token_ids
                    prepared.record.prompt_tokens = len(accepted.prompt_token_ids)
                    prepared.record.preprocess_ms = accepted.preprocess_ms
                    continue
                if seq is None:
                    seq = self._sequence_text(prepared)
                for output in event.outputs:
                    finish = output.finish_reason
                    if finish is FinishReason.ERROR:
                        raise OpenAIError("the engine failed to process the request", status=500)
                    stop_string = seq.update(output.new_token_ids, stop_terminated=finish is FinishReason.STOP)
                    finish_reason, stop_reason = None, None
                    if stop_string is not None:
                        finish_reason, stop_reason = "stop", stop_string
                    elif finish is not None:
                        finish_reason, stop_reason = finish.openai_name, output.stop_reason
                    text = seq.next_delta(finished=finish_reason is not None)
                    new_ids = seq.token_ids[emitted_ids:]
                    emitted_ids = len(seq.token_ids)
                    yield ChoiceDelta(index, text, new_ids, finish_reason, stop_reason)
                    if finish_reason is not None:
                        return
            raise OpenAIError("the engine stream ended without finishing the request", status=500)
        except (EngineOverloadedError, GatewayBusyError) as exc:  # one engine full: 429; the gateway's queues: 503
            raise OpenAIError(str(exc), status=503 if isinstance(exc, GatewayBusyError) else 429, retry_after_s=exc.retry_after_s) from None
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param) from None
        except ImageInputError as exc:
            raise bad_request(str(exc), "messages", "invalid_image") from None
        except EngineNotReadyError as exc:
            raise OpenAIError(f"no engine is ready: {exc}", status=503, retry_after_s=5) from None
        except EngineDeadError as exc:
            raise OpenAIError(f"the engine serving this request failed: {exc}", status=503, retry_after_s=5) from None
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

    async def _merged_deltas(self, prepared: PreparedRequest) -> AsyncIterator[ChoiceDelta]:
        """All choices' deltas, interleaved as they arrive, with their timings recorded."""
        record = prepared.record
        async for delta in self._interleaved_deltas(prepared):
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

    async def _interleaved_deltas(self, prepared: PreparedRequest) -> AsyncIterator[ChoiceDelta]:
        """All choices' deltas, interleaved as they arrive (n > 1 runs concurrently)."""
        if prepared.n == 1:
            async for delta in self._choice_deltas(prepared, 0):
                yield delta
            return
        queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for delta in self._choice_deltas(prepared, index):
                    await queue.put(delta)
                await queue.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(i)) for i in range(prepared.n)]
        try:
            remaining = prepared.n
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, prepared: PreparedRequest) -> list[ChoiceResult]:
        results = [ChoiceResult(i) for i in range(prepared.n)]
        async for delta in self._merged_deltas(prepared):
            result = results[delta.index]
            result.text += delta.text
            result.token_ids.extend(delta.token_ids)
            if delta.finish_reason is not None:
                result.finish_reason, result.stop_reason = delta.finish_reason, delta.stop_reason
        return results

    @staticmethod
    def _usage(prepared: PreparedRequest, completion_tokens: int) -> UsageInfo:
        prompt_tokens = len(prepared.prompt_token_ids)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)

    # ------------------------------------------------------------------ chat responses

    async def _chat_full(self, request: ChatCompletionRequest, prepared: PreparedRequest) -> ChatCompletionResponse:
        results = await self._collect(prepared)
        with_ids = bool(request.return_token_ids)
        return ChatCompletionResponse(
            id=prepared.request_id,
            created=prepared.created,
            model=self.model_name,
            choices=[
                ChatCompletionChoice(
                    index=r.index,
                    message=ResponseMessage(content=r.text),
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                    token_ids=r.token_ids if with_ids else None,
                )
                for r in results
            ],
            usage=self._usage(prepared, sum(len(r.token_ids) for r in results)),
            prompt_token_ids=prepared.prompt_token_ids if with_ids else None,
        )

    async def _chat_stream(self, request: ChatCompletionRequest, prepared: PreparedRequest) -> AsyncIterator[str]:
        with_ids = bool(request.return_token_ids)

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None, first: bool = False) -> str:
            body = ChatCompletionChunk(
                id=prepared.request_id, created=prepared.created, model=self.model_name, choices=choices, usage=usage,
                prompt_token_ids=prepared.prompt_token_ids if (with_ids and first) else None,
            )
            return _sse(body.model_dump_json(exclude_none=True))

        def delta_chunk(delta: ChoiceDelta) -> str:
            return chunk([
                ChatCompletionStreamChoice(
                    index=delta.index,
                    delta=DeltaMessage(content=delta.text),
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                    token_ids=delta.token_ids if with_ids else None,
                )
            ])

        # First chunk of every choice announces the role, as OpenAI and vLLM do.
        def opening() -> str:
            return chunk(
                [ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(prepared.n)],
                first=True,
            )

        async for event in self._sse_stream(request, prepared, delta_chunk, lambda usage: chunk([], usage=usage), opening):
            yield event

    async def _sse_stream(
        self,
        request: SamplingRequestFields,
        prepared: PreparedRequest,
        delta_chunk: Callable[[ChoiceDelta], str],
        usage_chunk: Callable[[UsageInfo], str],
        opening: Callable[[], str] | None = None,
    ) -> AsyncIterator[str]:
        """The SSE event stream shared by chat and text completions: deltas, usage, [DONE]."""
        with_ids = bool(request.return_token_ids)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        completion_tokens = 0
        deltas = self._merged_deltas(prepared)
        # Wait for the first output before the first event, outside the SSE error handling:
        # errors found until then (bad images, no engine) become HTTP errors (see `_started`).
        first_delta = await anext(deltas, None)
        try:
            if opening is not None:
                yield opening()
            async for delta in _prepend(first_delta, deltas):
                completion_tokens += len(delta.token_ids)
                if not delta.text and delta.finish_reason is None and not (with_ids and delta.token_ids):
                    continue
                yield delta_chunk(delta)
            if include_usage:
                yield usage_chunk(self._usage(prepared, completion_tokens))
        except OpenAIError as exc:
            yield _sse(exc.body().model_dump_json())
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ completion responses

    async def _completion_full(self, request: CompletionRequest, prepared: PreparedRequest) -> CompletionResponse:
        results = await self._collect(prepared)
        with_ids = bool(request.return_token_ids)
        return CompletionResponse(
            id=prepared.request_id,
            created=prepared.created,
            model=self.model_name,
            choices=[
                CompletionChoice(
                    index=r.index, text=r.text, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                    token_ids=r.token_ids if with_ids else None,
                    prompt_token_ids=prepared.prompt_token_ids if with_ids else None,
                )
                for r in results
            ],
            usage=self._usage(prepared, sum(len(r.token_ids) for r in results)),
        )

    async def _completion_stream(self, request: CompletionRequest, prepared: PreparedRequest) -> AsyncIterator[str]:
        with_ids = bool(request.return_token_ids)
        sent_prompt_ids: set[int] = set()

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            body = CompletionChunk(
                id=prepared.request_id, created=prepared.created, model=self.model_name, choices=choices, usage=usage
            )
            return _sse(body.model_dump_json(exclude_none=True))

        def delta_chunk(delta: ChoiceDelta) -> str:
            first = delta.index not in sent_prompt_ids
            sent_prompt_ids.add(delta.index)
            return chunk([CompletionChoice(
                index=delta.index, text=delta.text, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                token_ids=delta.token_ids if with_ids else None,
                prompt_token_ids=prepared.prompt_token_ids if (with_ids and first) else None,
            )])

        async for event in self._sse_stream(request, prepared, delta_chunk, lambda usage: chunk([], usage=usage)):
            yield event


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _with_seed(sampling: SamplingParams, seed: int) -> SamplingParams:
    return msgspec.structs.replace(sampling, seed=seed)


def _to_text_message(message: ChatMessage) -> TextChatMessage:
    """OpenAI message → the text layer's message (image parts keep only their position)."""
    content = message.content
    if isinstance(content, list):
        content = tuple(
            TextContentPart(part.text) if part.type == "text" else MediaPart("image") for part in content
        )
    return TextChatMessage(role=message.role, content=content, name=message.name, tool_call_id=message.tool_call_id)


async def _prepend(first: ChoiceDelta | None, rest: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
    if first is None:
        return
    yield first
    async for item in rest:
        yield item
