"""The images of one request on their way to the engine client that takes it.

The ingress never processes images itself: it sends an engine client the request with its images'
URLs (data URIs included) and the preprocessor's name (`ImageRequest`), and the engine client has the
preprocessor process them, their pixels coming to it through the object store.
"""

from __future__ import annotations

from mmserve.multimodal import ImageBatchRequest
from mmserve.wire import EngineCoreRequest

from .engine_link import ImageRequest, PreprocessorName
from .affinity import image_key


class PendingImages:
    """The images of one request until an engine client has the pixels of each of its `choices`
    engine requests (`delivered()`); then the URLs (up to 8 data URIs of 27 MB) are dropped: nothing
    will need them again. Until then a request refused for a lost replica can be sent again. The
    `n` > 1 choices name their request as their `group`: an engine client processes their images
    once for all of them."""

    __slots__ = ("_choices", "choices", "group", "image_keys", "preprocessor", "request")

    def __init__(self, request: ImageBatchRequest, preprocessor: PreprocessorName, group: str = "", choices: int = 1) -> None:
        self.request: ImageBatchRequest | None = request
        self.preprocessor = preprocessor
        self.group = group
        self.choices = self._choices = choices
        self.image_keys = tuple(image_key(url) for url in request.urls)  # routing affinity

    def message(self, caller: str, request: EngineCoreRequest) -> ImageRequest:
        """What the engine client is sent for `request` (one of this request's choices)."""
        if self.request is None:
            raise RuntimeError("the images were delivered already")
        return ImageRequest(caller, request, self.request, self.preprocessor, self.group, self.choices if self.group else 1)

    def delivered(self) -> None:
        self._choices -= 1
        if self._choices <= 0:
            self.request = None
