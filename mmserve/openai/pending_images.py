"""The images of one request on their way to an engine client, and the preprocessor as the router reaches it.

The ingress never processes images itself, nor resolves the preprocessor's answer: either the
engine client that takes the request calls the preprocessor (the request goes to it over the link
with its image URLs), or the ingress starts the call and hands its response on unawaited (the
request goes as a Ray call). How the preprocessor is reached is `deployments/preprocessor_calls.py`'s
business.
"""

from __future__ import annotations

from typing import Protocol

from mmserve.multimodal import ImageBatchRequest
from mmserve.protocol import PreprocessorName

from .engine_affinity import image_key

# Image URLs (data URIs) of more characters than this in one request do not go over the link: the
# engine client would receive and decode them on the loop that relays every stream's tokens (the
# decoding alone 0.56 ms per 4 MB, 2.2 per 16 MB, measured with msgspec here), only to pass them on to
# the preprocessor through Ray's object store (`inline_args.py`: an argument over 1 MiB goes there).
# They go from the ingress to the preprocessor instead, as before the link.
LINK_MAX_URL_CHARS = 1024 * 1024


class Preprocessing(Protocol):
    """The preprocessor as the router reaches it."""

    @property
    def name(self) -> PreprocessorName | None:
        """The preprocessor's deployment, for engine clients to call it themselves; None: they cannot."""
        ...

    def process(self, request: ImageBatchRequest) -> object:
        """Start preprocessing `request`; an opaque response the engine client resolves."""
        ...


class PendingImages:
    """The images of one request, on their way to the engine client that takes the request: either
    sent to it as they are (`for_link`), and it has the preprocessor process them, or processed here
    by a call to the preprocessor whose response goes to it unawaited (`response`); one or the other,
    whichever the request's connection asks for first. A request's `n` children (`shared`) share
    one response, started at once. Images whose URLs are too long for the link always take the
    second way. Once an engine client has the pixels (`delivered()`), the request (its URLs: up to 8
    data URIs of 27 MB) is dropped: nothing will need it again."""

    __slots__ = ("_preprocessing", "_response", "_url_chars", "image_keys", "request")

    def __init__(self, request: ImageBatchRequest, preprocessing: Preprocessing, shared: bool = False) -> None:
        self.request: ImageBatchRequest | None = request
        self._preprocessing = preprocessing
        self._response: object | None = preprocessing.process(request) if shared else None
        self._url_chars = sum(len(url) for url in request.urls)
        self.image_keys = tuple(image_key(url) for url in request.urls)  # routing affinity

    def for_link(self) -> tuple[ImageBatchRequest, PreprocessorName] | None:
        """The images and the preprocessor to process them, for an engine client to do it; None if
        processing already started here, the preprocessor cannot be named, or the URLs are too long
        for the link (`LINK_MAX_URL_CHARS`)."""
        name = self._preprocessing.name
        if self._response is not None or self.request is None or name is None or self._url_chars > LINK_MAX_URL_CHARS:
            return None
        return self.request, name

    def response(self) -> object:
        """The preprocessor's response for the engine client, its call started on first use."""
        if self._response is None:
            if self.request is None:
                raise RuntimeError("the images were delivered already")
            self._response = self._preprocessing.process(self.request)
        return self._response

    def again(self) -> "PendingImages":
        """The same images, to be processed anew (the replica processing them died)."""
        assert self.request is not None
        return PendingImages(self.request, self._preprocessing)

    def delivered(self) -> None:
        self.request = None
