"""Input processing: OpenAI request → prompt token ids and the engine's `SamplingParams`, as vLLM's front-end makes them.

One home for each input rule: the prompt's characters before templating, the context rule
(`mmserve.engine.fit_max_tokens`, shared with the engine client's last check), the
`generation_config.json` defaults, EOS and stop ids, greedy normalisation. Templating and
tokenizing long prompts run in a small thread pool, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from jinja2 import TemplateError

from mmserve.engine import context_exceeded, fit_max_tokens
from mmserve.multimodal import load_image_family
from mmserve.text import (
    ConversationMessage,
    MediaContent,
    ModelFiles,
    TextContent,
    Tokenizer,
    ToolCall as TextToolCall,
    load_chat_template,
    resolve_stop_token_ids,
)
from mmserve.wire import SamplingParams, StructuredOutputsParams

from . import request_checks
from mmserve.transit.router import EngineLimits, PendingImages
from .errors import OpenAIError, bad_request
from .intake import text_chars
from .metrics import RequestRecord
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequestFields
from .settings import ServingSettings
from .tool_calls import template_tools

# Prompts with at least this many characters of text are templated and tokenized off the event
# loop: their work, proportional to their length, would hold up every other request's.
PROMPT_INLINE_CHARS = 32 * 1024
# Worker threads for long prompts, per ingress replica; more would only compete for the cores.
PROMPT_THREADS = 2
IMAGE_URL_SCHEMES = ("data", "http", "https", "file")
T = TypeVar("T")


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
    # The number of top logprobs each token shows (-1: all the engine sent); None when not asked for.
    top_logprobs: int | None = None
    # `EngineCoreRequest.reasoning_ended` (chat with a reasoning parser, or `include_reasoning: false`).
    reasoning_ended: bool | None = None
    # `EngineCoreRequest.reasoning_parser_kwargs` (chat with a reasoning parser).
    reasoning_parser_kwargs: dict[str, Any] | None = None
    # Preprocessing under way (its response is never resolved in the ingress), None for text only.
    images: PendingImages | None = None
    # Timings and counts for metrics and the request's log line.
    record: RequestRecord = field(default_factory=lambda: RequestRecord("unknown"))

    def attach(self, record: RequestRecord | None, num_images: int = 0) -> None:
        """Record this request's id and prompt in `record` (the ingress's), or in its own."""
        if record is not None:
            self.record = record
        self.record.request_id = self.request_id
        self.record.prompt_tokens = len(self.prompt_token_ids)
        self.record.num_images = num_images

    def images_delivered(self) -> None:
        """An engine client has the pixels: the image URLs and the body budget they held go."""
        if self.images is not None:
            self.images.delivered()
        if self.record.lease is not None:
            self.record.lease.release()


class InputProcessor:
    """The model's tokenizer, chat template and generation defaults, and the rules that use them."""

    def __init__(self, settings: ServingSettings) -> None:
        self.settings = settings
        self.limits = settings.limits
        self.model_files = ModelFiles.load(settings.model_dir)
        self.tokenizer = Tokenizer.from_model_files(self.model_files)
        self.image_family = load_image_family(settings.model_dir)
        placeholders = self.image_family.chat_placeholders if self.image_family else None
        self.chat_template = (
            load_chat_template(self.model_files, placeholders) if placeholders else load_chat_template(self.model_files)
        )
        # Upper bound of the characters one token covers (byte-level BPE vocab strings have one
        # character per byte; SentencePiece's have one per character).
        self.longest_token_chars = max(len(t) for t in self.tokenizer.backend.get_vocab(with_added_tokens=True))
        self._prompt_pool = ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="mmserve-prompt")

    # ------------------------------------------------------------------ prompts

    def take_image_urls(self, request: ChatCompletionRequest) -> list[str]:
        """Image URLs in prompt order, checked for count and scheme (and the messages counted)
        before any work is started. They move out of the request (its parts keep their place
        with an empty URL): a data URI can be 27 MB, and the request lives as long as its
        generation, while the URLs are needed only until the preprocessor has them."""
        if len(request.messages) > self.limits.max_messages:  # also checked while decoding (intake.py)
            raise bad_request(f"at most {self.limits.max_messages} messages are allowed (limits.max_messages)", "messages")
        parts = [
            part.image_url
            for message in request.messages
            if isinstance(message.content, list)
            for part in message.content
            if part.type == "image_url"
        ]
        if not parts:
            return []
        if self.image_family is None:
            raise bad_request(f"the model {self.settings.model_name} does not take image inputs", "messages")
        limit = self.settings.max_images_per_request
        if len(parts) > limit:
            raise OpenAIError(
                f"{len(parts)} images in one request; at most {limit} are allowed (images.max_images_per_request)",
                status=413, param="messages", code="too_many_images",
            )
        urls = [part.url for part in parts]
        for url in urls:
            scheme = url.split(":", 1)[0].lower() if ":" in url else ""
            if scheme not in IMAGE_URL_SCHEMES:
                raise bad_request(f"unsupported image URL scheme {scheme or url[:16]!r}", "messages")
        for part in parts:
            part.url = ""
        return urls

    async def chat_prompt(self, request: ChatCompletionRequest, limits: EngineLimits) -> list[int]:
        """The rendered chat template, tokenized; each image is ONE placeholder token here (the
        engine client expands it once the preprocessor has measured the image)."""
        tools = template_tools(request)
        # Tools and the history's tool-call arguments are prompt text too.
        chars = sum(text_chars(m.content) + sum(len(c.function.arguments) for c in m.tool_calls or ()) for m in request.messages)
        chars += len(json.dumps(tools)) if tools else 0
        chars += len(json.dumps(request.chat_template_kwargs)) if request.chat_template_kwargs else 0  # may be rendered
        self.check_prompt_chars(chars, limits, "messages")
        messages = [_conversation_message(m) for m in request.messages]

        def render_and_tokenize() -> list[int]:
            try:
                prompt_text = self.chat_template.render(
                    messages,
                    add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message,
                    reasoning_effort=request.reasoning_effort,
                    tools=tools,
                    template_kwargs=request.chat_template_kwargs,
                )
            except (ValueError, TemplateError) as exc:
                raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
            # vLLM's chat path tokenizes the rendered template without adding special tokens.
            return self._encode(prompt_text, add_special_tokens=False)

        return await self._prompt_work(render_and_tokenize, chars)

    @staticmethod
    def single_prompt(request: CompletionRequest) -> str | list[int]:
        """The request's one prompt, text or token ids; batches of several are refused."""
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) != 1 and not (prompt and isinstance(prompt[0], int)):
            raise bad_request("batched prompts are not supported; send one prompt per request", "prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a one-element batch
        return prompt

    async def completion_prompt(self, prompt: str | list[int], limits: EngineLimits) -> list[int]:
        """A completion prompt (see `single_prompt`) as token ids, checked against the context."""
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), limits, "prompt")
            text = prompt
            prompt_ids = await self._prompt_work(lambda: self._encode(text, add_special_tokens=True), len(text))
        else:
            prompt_ids = list(prompt)
            if len(prompt_ids) >= limits.max_model_len:
                raise context_exceeded(limits.max_model_len, len(prompt_ids), "prompt")
            request_checks.check_token_ids(prompt_ids, self.tokenizer.max_token_id, "prompt")
        if not prompt_ids:
            raise bad_request("the prompt is empty", "prompt")
        return prompt_ids

    def max_prompt_chars(self, limits: EngineLimits) -> int:
        """More characters than this cannot fit the context: every token covers at most
        `longest_token_chars` of them (see `limits.max_prompt_chars`)."""
        if self.limits.max_prompt_chars is not None:
            return self.limits.max_prompt_chars
        max_tokens = min(limits.max_model_len, self.limits.max_prompt_tokens or limits.max_model_len)
        return max_tokens * self.longest_token_chars

    def check_prompt_chars(self, chars: int, limits: EngineLimits, param: str) -> None:
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

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` in the prompt pool: for the grammar compiler's parse of a request's structured
        outputs or tool schemas, which grows with the schema or grammar (up to vLLM's 5 s timeout for a
        regex), none of it on the event loop the replica's other streams run on."""
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, work, *args)

    # ------------------------------------------------------------------ sampling

    def prepare(
        self,
        request: SamplingRequestFields,
        prompt_ids: list[int],
        max_tokens: int | None,
        id_prefix: str,
        limits: EngineLimits,
        structured: StructuredOutputsParams | None,
        num_images: int = 0,
        logprobs: int | None = None,
        shown_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> PreparedRequest:
        """Check the sampling fields and build the engine's `SamplingParams` (one child's: n = 1).
        `logprobs`: the number of top logprobs per token to compute, None for none; `shown_logprobs`:
        how many of them each token shows (default: all `logprobs`; -1: every entry of its dict);
        `prompt_logprobs`: the same for the prompt's positions; `structured`: `structured_outputs(request)`,
        checked beforehand off the event loop (`off_loop`)."""
        prompt_len = len(prompt_ids)
        prompt_param = "messages" if id_prefix == "chatcmpl" else "prompt"
        if self.limits.max_prompt_tokens and prompt_len > self.limits.max_prompt_tokens:
            raise context_exceeded(limits.max_model_len, prompt_len, prompt_param)
        fitted = fit_max_tokens(prompt_len, max_tokens, limits.max_model_len, prompt_param)
        defaults = self.model_files.generation_config.sampling_defaults
        # With images the final prompt length is known only after preprocessing: the engine
        # client completes the context rule (and the max_tokens default) for image requests.
        engine_max_tokens = max_tokens
        if max_tokens is None and defaults.max_tokens is not None:
            fitted = engine_max_tokens = min(fitted, defaults.max_tokens)
        elif max_tokens is None and not num_images:
            engine_max_tokens = fitted
        request_checks.check_sampling(request, fitted, self.limits, self.tokenizer.max_token_id)

        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        stop_ids = resolve_stop_token_ids(
            tokenizer_eos_token_id=self.tokenizer.eos_token_id,
            generation_eos_token_ids=self.model_files.generation_config.eos_token_ids,
            request_stop_token_ids=list(dict.fromkeys(request.stop_token_ids or [])),
            ignore_eos=request.ignore_eos,
        )
        sampling = self._sampling_params(request, stop, stop_ids, engine_max_tokens, structured)
        sampling.logprobs = logprobs
        sampling.prompt_logprobs = prompt_logprobs
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
            top_logprobs=None if logprobs is None else (logprobs if shown_logprobs is None else shown_logprobs),
        )

    def _sampling_params(
        self, request: SamplingRequestFields, stop: list[str], stop_ids, max_tokens: int | None,
        structured: StructuredOutputsParams | None,
    ) -> SamplingParams:
        """The request's values, else `generation_config.json`'s, else vLLM's defaults."""
        defaults = self.model_files.generation_config.sampling_defaults

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
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            structured_outputs=structured,
            logit_bias={int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None,
            allowed_token_ids=list(request.allowed_token_ids) if request.allowed_token_ids else None,
            bad_words=list(dict.fromkeys(request.bad_words)) if request.bad_words else None,
            _bad_words_token_ids=request_checks.bad_words_token_ids(
                request.bad_words or [], lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                self.tokenizer.max_token_id,
            ),
            _eos_token_id=stop_ids.eos_token_id,
            _all_stop_token_ids=set(stop_ids.all_stop_token_ids),
        )
        if sampling.temperature < 1e-5:
            # vLLM's greedy normalisation (SamplingParams.__post_init__).
            sampling.top_p, sampling.top_k, sampling.min_p = 1.0, 0, 0.0
        return sampling


def _conversation_message(message: ChatMessage) -> ConversationMessage:
    """OpenAI message → the text layer's message (image parts keep only their position)."""
    content = message.content
    if isinstance(content, list):
        content = tuple(TextContent(part.text) if part.type == "text" else MediaContent("image") for part in content)
    tool_calls = None
    if message.tool_calls is not None:
        tool_calls = tuple(TextToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls)
    return ConversationMessage(
        role=message.role, content=content, name=message.name, tool_call_id=message.tool_call_id, tool_calls=tool_calls
    )
