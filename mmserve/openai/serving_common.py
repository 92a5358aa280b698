"""What every endpoint's serving shares: the settings, the engine router, the input and output processors, the model check."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.transit.router import EngineLimits, EngineRouting
from .errors import OpenAIError, openai_error
from .input_processing import InputProcessor
from .logprobs import PromptLogprobs
from .output_parsing import ReasoningSetup
from .output_processing import OutputProcessor
from .protocol import PromptLogprob
from .protocol import PromptLogprobs as PromptLogprobsBody
from .settings import ServingSettings


@dataclass
class ServingContext:
    settings: ServingSettings
    router: EngineRouting
    inputs: InputProcessor
    outputs: OutputProcessor
    # The model's reasoning parser, its tags found in the tokenizer (None: not configured).
    reasoning: ReasoningSetup | None

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                status=400, param="model", code="model_not_found",
            )

    async def engine_limits(self) -> EngineLimits:
        """A ready engine's limits; waits for one (up to the router's wait), else a 503."""
        try:
            return await self.router.limits()
        except Exception as exc:
            error = openai_error(exc)
            if error is None:
                raise
            raise error from None


def prompt_logprobs_response(positions: PromptLogprobs) -> PromptLogprobsBody:
    """The prompt's logprobs as the response models hold them (built, not validated: they are ours)."""
    return [
        None if entries is None else {
            token_id: PromptLogprob.model_construct(logprob=e.logprob, rank=e.rank, decoded_token=e.decoded_token)
            for token_id, e in entries.items()
        }
        for entries in positions
    ]
