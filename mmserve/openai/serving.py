"""`OpenAIServer`: the OpenAI endpoints over an engine router, one plain object per ingress replica, testable without Ray.

Per request: request checks → input processing (template, tokens, context rule, sampling
parameters; `input_processing.py`) → one engine request per choice (`parallel_sampling.py`) →
output processing (detokenization, stop strings, finish reasons; `output_processing.py`) →
one response, or SSE events (`sse.py`). Leaving a stream early (stop string, client gone)
closes the engine stream, which aborts the engine request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from mmserve.vision import resize_path

from mmserve.transit.router import EngineRouting
from .grammar_check import load_grammar_parser
from .input_processing import InputProcessor
from .metrics import Metrics, RequestRecord
from .output_parsing import reasoning_setup
from .output_processing import OutputProcessor
from .protocol import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, ModelList
from .serving_chat import ChatServing
from .serving_common import ServingContext
from .serving_completions import CompletionServing
from .serving_models import ModelsServing
from .settings import ServingSettings


class OpenAIServer:
    def __init__(self, settings: ServingSettings, router: EngineRouting, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.router = router
        self.metrics = metrics
        # The grammar compiler's parser, loaded now: without it the server does not start (see grammar_check).
        load_grammar_parser()
        self.inputs = InputProcessor(settings)
        self.outputs = OutputProcessor(self.inputs.tokenizer, router, metrics)
        reasoning = reasoning_setup(settings.reasoning_parser, self.inputs.tokenizer)
        context = ServingContext(settings, router, self.inputs, self.outputs, reasoning)
        self._chat = ChatServing(context)
        self._completions = CompletionServing(context)
        self._models = ModelsServing(context)
        if metrics is not None and self.image_family is not None:
            metrics.set_resize_path(resize_path())

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    @property
    def image_family(self):
        return self.inputs.image_family

    async def chat(self, request: ChatCompletionRequest, record: RequestRecord | None = None) -> ChatCompletionResponse | AsyncIterator[str]:
        return await self._chat.chat(request, record)

    async def completion(self, request: CompletionRequest, record: RequestRecord | None = None) -> CompletionResponse | AsyncIterator[str]:
        return await self._completions.completion(request, record)

    async def models(self) -> ModelList:
        return await self._models.models()
