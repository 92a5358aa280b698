"""The images of requests that reach an engine client over the link (`ImageRequest`).

The engine client gets their pixels itself: it has the preprocessor the request names process
them (`preprocessor_calls.py`: over the preprocessing link once attached to its replicas), or, when every image is a data URI it saw before and the engine
still holds, recalls them without pixels (`RecentImages`) and sends the request at once by hash
only, keeping the way to process them anew should the engine have let them go meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from mmserve.multimodal import ImagesRefused, ProcessedImages
from mmserve.multimodal.recent_images import RecentImages
from mmserve.protocol import ImageRequest

from .engine_client_server import Reprocess
from .preprocessor_calls import PreprocessorCalls


class LinkImages:
    """One engine client's images for link requests; each processing cancellable by its caller and
    request id (an abort, the caller's end). `engine_holds(mm_hashes)`: whether the engine holds
    those images now; `host`: the address this replica's preprocessing answers arrive at."""

    def __init__(self, engine_holds: Callable[[Iterable[str]], bool], host: str) -> None:
        self._engine_holds = engine_holds
        self._preprocessors = PreprocessorCalls(host)
        self._recent = RecentImages()
        self._processing: dict[tuple[str, str], asyncio.Future[ProcessedImages | ImagesRefused]] = {}
        # Requests whose images were recalled, not processed (`EngineInfo.link_images_recalled`).
        self.recalled = 0

    async def process(self, message: ImageRequest) -> ProcessedImages | ImagesRefused | None:
        """The request's images (recalled without pixels if the engine holds them all); None if an
        abort, or the caller's end, cancelled their processing."""
        keys = RecentImages.keys(message.preprocessor, message.images)
        if keys is not None and (recalled := self._recent.recall(keys)) is not None:
            if self._engine_holds(image.mm_hash for image in recalled.images):
                self.recalled += 1
                return recalled
        key = (message.caller, message.request.request_id)
        processing = asyncio.ensure_future(self._preprocessors.process(message.images, message.preprocessor))
        self._processing[key] = processing
        try:
            await asyncio.wait({processing})
        finally:
            processing.cancel()  # (this call was cancelled: the processing goes with it)
            self._processing.pop(key, None)
        if processing.cancelled():
            return None
        images = processing.result()
        if keys is not None and isinstance(images, ProcessedImages):
            self._recent.remember(keys, images)
        return images

    def reprocess(self, message: ImageRequest) -> Reprocess:
        """The request's images processed anew, for a request sent with recalled images."""
        return lambda: self._preprocessors.process(message.images, message.preprocessor)

    def cancel(self, caller: str, request_id: str) -> None:
        if (processing := self._processing.get((caller, request_id))) is not None:
            processing.cancel()

    @property
    def over_preprocessing_link(self) -> int:
        return self._preprocessors.over_link

    def close(self) -> None:
        self._preprocessors.close()

    def cancel_caller(self, caller: str) -> None:
        for (of_caller, _), processing in list(self._processing.items()):
            if of_caller == caller:
                processing.cancel()
