"""The images of the requests that reach an engine client (`ImageRequest`).

The engine client gets their pixels itself: it has the preprocessor the request names process them
over the preprocessing link (`preprocessor_calls.py`; the pixels come through the object store), or,
when every image is a data URI it saw before and the engine still holds, recalls them without pixels
(`RecentImages`) and sends the request at once by hash only, keeping the way to process them anew
should the engine have let them go meanwhile. The choices of one `n` > 1 request share one
processing (`ImageRequest.group`): kept for the choices still to come until all of them came, or
until `GROUP_HOLD_S` after it ended (those choices went to another engine client, or were never sent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from mmserve.multimodal import ProcessedImages
from mmserve.multimodal.recent_images import RecentImages
from mmserve.transit.engine_link import ImageRequest
from mmserve.transit.refusals import Refusal

from .engine_client_server import Reprocess
from .pixel_store import RayPixelStore
from .preprocessor_calls import PreprocessorCalls

Answer = ProcessedImages | Refusal

# The choices of a request leave the ingress together; one may come after the others' processing
# ended, by the time a loaded ingress or link takes. Longer holds only keep pixels alive.
GROUP_HOLD_S = 10.0


class _Shared:
    """One processing and the requests waiting for it: cancelled when the last of them is, unless
    it ended; `to_come`: the group's choices not yet joined."""

    def __init__(self, processing: asyncio.Future[Answer], to_come: int) -> None:
        self.processing = processing
        self.waiting = 0
        self.to_come = to_come


class LinkImages:
    """One engine client's images for its requests; each processing cancellable by its caller and
    request id (an abort, the caller's end). `engine_holds(mm_hashes)`: whether the engine holds
    those images now; `host`: the address this replica's preprocessing answers arrive at;
    `attach_timeout_s`: how long a request waits for a preprocessor replica to attach."""

    def __init__(self, engine_holds: Callable[[Iterable[str]], bool], host: str, attach_timeout_s: float) -> None:
        self._engine_holds = engine_holds
        self._preprocessors = PreprocessorCalls(host, RayPixelStore(), attach_timeout_s)
        self._recent = RecentImages()
        self._processing: dict[tuple[str, str], asyncio.Future[Answer | None]] = {}
        self._groups: dict[tuple[str, str], _Shared] = {}
        # Requests whose images were recalled, not processed (`EngineInfo.images_recalled`).
        self.recalled = 0

    async def process(self, message: ImageRequest) -> Answer | None:
        """The request's images (recalled without pixels if the engine holds them all); None if an
        abort, or the caller's end, cancelled their processing."""
        keys = RecentImages.keys(message.preprocessor, message.images)
        if keys is not None and (recalled := self._recent.recall(keys)) is not None:
            if self._engine_holds(image.mm_hash for image in recalled.images):
                self.recalled += 1
                return recalled
        key = (message.caller, message.request.request_id)
        waiting = self._processing[key] = asyncio.ensure_future(self._shared(message))
        try:
            await asyncio.wait({waiting})
        finally:
            waiting.cancel()  # (this call was cancelled: the waiting goes with it)
            self._processing.pop(key, None)
        if waiting.cancelled():
            return None
        images = waiting.result()
        if keys is not None and isinstance(images, ProcessedImages):
            self._recent.remember(keys, images)
        return images

    async def _shared(self, message: ImageRequest) -> Answer:
        """The images processed for this request, or for the first request of its group."""
        group = (message.caller, message.group) if message.group else None
        shared = self._groups.get(group) if group is not None else None
        if shared is not None and shared.processing.cancelled():
            shared = None  # (its choices were all given up: this one starts again)
        if shared is None:
            shared = _Shared(asyncio.ensure_future(self._preprocessors.process(message.images, message.preprocessor)), message.choices)
            if group is not None:
                self._hold(group, shared)
        shared.to_come -= 1
        if group is not None and shared.to_come <= 0 and self._groups.get(group) is shared:
            del self._groups[group]
        shared.waiting += 1
        try:
            return await asyncio.shield(shared.processing)
        finally:
            shared.waiting -= 1
            if shared.waiting == 0:
                shared.processing.cancel()  # (done already, unless every request waiting was cancelled)

    def _hold(self, group: tuple[str, str], shared: _Shared) -> None:
        """Keep the group's processing for its choices to come, until `GROUP_HOLD_S` after it ended."""
        self._groups[group] = shared
        loop = asyncio.get_running_loop()

        def release() -> None:
            if self._groups.get(group) is shared:
                del self._groups[group]

        shared.processing.add_done_callback(lambda _: loop.call_later(GROUP_HOLD_S, release))

    def reprocess(self, message: ImageRequest) -> Reprocess:
        """The request's images processed anew, for a request sent with recalled images."""
        return lambda: self._preprocessors.process(message.images, message.preprocessor)

    @property
    def jobs(self) -> int:
        return self._preprocessors.jobs

    def cancel(self, caller: str, request_id: str) -> None:
        if (processing := self._processing.get((caller, request_id))) is not None:
            processing.cancel()

    def close(self) -> None:
        self._preprocessors.close()

    def cancel_caller(self, caller: str) -> None:
        for (of_caller, _), processing in list(self._processing.items()):
            if of_caller == caller:
                processing.cancel()
        for group in [group for group in self._groups if group[0] == caller]:
            del self._groups[group]
