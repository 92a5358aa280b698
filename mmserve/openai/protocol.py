"""OpenAI API request and response bodies (the subset mmserve serves), as pydantic models.

Requests are validated in strict mode straight from the JSON bytes, so a string where a
number belongs is a 400, not a silent conversion. Fields vLLM's server accepts beyond
OpenAI's (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids,
skip_special_tokens, include_stop_str_in_output, return_token_ids, structured_outputs,
bad_words, allowed_token_ids, prompt_logprobs) are accepted too; a vLLM field this server does not
implement (truncate_prompt_tokens) is parsed only to be refused with a 400.
Unknown fields are ignored, as OpenAI and vLLM do. Ranges and cross-field rules are checked
in `request_checks.py` and `structured_outputs.py`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Unknown fields are kept (not used) so that request_checks can refuse the vLLM fields mmserve does not
# implement instead of dropping them without a word.
_REQUEST = ConfigDict(extra="allow", strict=True)


class ImageURL(BaseModel):
    model_config = _REQUEST
    url: str
    # Accepted and ignored, as vLLM does.
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(BaseModel):
    model_config = _REQUEST
    type: Literal["text"]
    text: str


class ImageURLPart(BaseModel):
    model_config = _REQUEST
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    """An assistant message's call of a function (OpenAI's `function` of a tool call): the arguments
    are JSON text, as the model wrote them."""

    model_config = _REQUEST
    name: str
    arguments: str


class ToolCall(BaseModel):
    """An entry of an assistant message's `tool_calls` (vLLM's `ChatCompletionMessageToolCallParam`)."""

    model_config = _REQUEST
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _REQUEST
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # Assistant messages of the history: the calls the model made.
    tool_calls: list[ToolCall] | None = None


class FunctionDefinition(BaseModel):
    """A tool's function (vLLM's `FunctionDefinition`)."""

    model_config = _REQUEST
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatCompletionTool(BaseModel):
    """An entry of `tools` (vLLM's `ChatCompletionToolsParam`)."""

    model_config = _REQUEST
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def template_dict(self) -> dict:
        """The tool as the chat template sees it: vLLM's `model_dump()` of its `ChatCompletionToolsParam`
        (unknown keys dropped, `description` and `parameters` kept when null, `strict` only when set)."""
        function = {"name": self.function.name, "description": self.function.description, "parameters": self.function.parameters}
        if self.function.strict is not None:
            function["strict"] = self.function.strict
        return {"type": "function", "function": function}


class StreamOptions(BaseModel):
    model_config = _REQUEST
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field (`StructuredOutputsParams` of vLLM 0.32)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    # `json` would shadow BaseModel.json: named json_schema here, "json" in requests.
    json_schema: str | dict | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class SamplingRequestFields(BaseModel):
    """Sampling fields shared by chat and text completions."""

    model_config = _REQUEST

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extension: return prompt and generated token ids alongside the text.
    return_token_ids: bool | None = False
    # vLLM extensions: constrained decoding and token filters.
    structured_outputs: StructuredOutputsRequest | None = None
    response_format: dict | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM extension: the prompt's logprobs (non-streamed answers), this many top entries per position.
    prompt_logprobs: int | None = None
    # vLLM extension refused with a 400 (not implemented here).
    truncate_prompt_tokens: int | None = None

    @property
    def has_structured_outputs(self) -> bool:
        """A constraint (or a `response_format`) to check: parsed by the grammar compiler, off the event loop."""
        return self.structured_outputs is not None or self.response_format is not None


class ChatCompletionRequest(SamplingRequestFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionTool] | None = None
    # "none" | "auto" | "required" | a named function: checked in tool_calls.py as vLLM checks it, in its words.
    tool_choice: str | dict | None = None
    # False: at most one call (the engine stops after it, the answer keeps the first).
    parallel_tool_calls: bool | None = True
    # False: no reasoning in the answer and, with a parser configured, no logprobs or token ids shown
    # (vLLM hides them so that reasoning tokens do not leak).
    include_reasoning: bool = True
    # For the chat template: its own variables (Qwen3's `enable_thinking`, ...), and the effort a
    # reasoning template reads (`enable_thinking` too, unless given), merged as vLLM merges them.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None


class CompletionRequest(SamplingRequestFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    suffix: str | None = None
    logprobs: int | None = None


# ----------------------------------------------------------------------------- responses


class CompletionTokenUsageInfo(BaseModel):
    """vLLM's `CompletionTokenUsageInfo`: the usage's details when a reasoning parser is on."""

    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: CompletionTokenUsageInfo | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # The calls a tool-call parser read in the answer.
    tool_calls: list[ToolCall] | None = None
    # What a reasoning parser read as the model's reasoning (vLLM's field name).
    reasoning: str | None = None


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`, as `prompt_logprobs` shows it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt position: None for the first, else {token id: its logprob}.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatCompletionChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: str | None = None
    # vLLM reports the matched stop string or token id here.
    stop_reason: int | str | None = None
    logprobs: ChatCompletionLogProbs | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: ChatCompletionLogProbs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: CompletionLogProbs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None

class GatewayInfo(BaseModel):
    """What this gateway's install gives it (not part of OpenAI's model object)."""

    # "numba-exact" (the default), "pillow-simd" or "numpy-exact": all byte-identical to vLLM's HF processors.
    image_resize: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mmserve"
    root: str | None = None
    max_model_len: int | None = None
    # Which engine serves it: "vllm" or "mmserve-builtin" (deterministic, not a real model).
    engine: str | None = None
    mmserve: GatewayInfo | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
