"""`GET /v1/models`: the served model, its context length and which engine serves it."""

from __future__ import annotations

from mmserve.engine import EngineError
from mmserve.vision import resize_path

from .protocol import GatewayInfo, ModelCard, ModelList
from .serving_common import ServingContext


class ModelsServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def models(self) -> ModelList:
        context = self.context
        try:
            # Never wait for an engine here: listing models must answer while engines are down.
            limits = await context.router.limits(wait=False)
            max_len, engine = limits.max_model_len, limits.engine_kind
        except EngineError:
            max_len, engine = None, None
        card = ModelCard(id=context.model_name, root=str(context.settings.model_dir), max_model_len=max_len, engine=engine)
        if context.inputs.image_family is not None:
            # The preprocessor replicas run from this same environment, so they resize the same way.
            card.mmserve = GatewayInfo(image_resize=resize_path())
        return ModelList(data=[card])
