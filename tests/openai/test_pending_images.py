"""`PendingImages`: a request's images go one way, over the link for the engine client to process,
or as the ingress's own call to the preprocessor; never both, and nothing is kept once delivered."""

from __future__ import annotations

import pytest

from mmserve.multimodal import ImageBatchRequest
from mmserve.multimodal.types import PixelMode
from mmserve.openai.pending_images import LINK_MAX_URL_CHARS, PendingImages
from mmserve.protocol import PreprocessorName

NAME = PreprocessorName("app", "Preprocessor")


class CountingPreprocessing:
    def __init__(self, name: PreprocessorName | None = NAME) -> None:
        self.name = name
        self.started: list[ImageBatchRequest] = []

    def process(self, request: ImageBatchRequest) -> str:
        self.started.append(request)
        return f"response-{len(self.started)}"


def _request() -> ImageBatchRequest:
    return ImageBatchRequest(urls=["data:image/png;base64,AAAA"], pixel_mode=PixelMode.DEVICE_NORMALIZE, engine_dtype="bfloat16")


def test_a_request_of_its_own_goes_over_the_link_without_a_call_from_here():
    preprocessing = CountingPreprocessing()
    images = PendingImages(_request(), preprocessing)
    assert images.for_link() == (_request(), NAME)
    assert preprocessing.started == []


def test_once_a_call_started_here_the_link_gets_nothing_and_the_call_is_made_once():
    preprocessing = CountingPreprocessing()
    images = PendingImages(_request(), preprocessing)
    assert images.response() == "response-1"
    assert images.response() == "response-1"
    assert images.for_link() is None
    assert len(preprocessing.started) == 1


def test_shared_images_start_their_call_at_once_for_all_children():
    preprocessing = CountingPreprocessing()
    images = PendingImages(_request(), preprocessing, shared=True)
    assert len(preprocessing.started) == 1
    assert images.for_link() is None
    assert images.response() == "response-1"


def test_a_preprocessor_engine_clients_cannot_call_is_called_from_here():
    images = PendingImages(_request(), CountingPreprocessing(name=None))
    assert images.for_link() is None
    assert images.response() == "response-1"


def test_delivered_images_are_dropped_and_again_starts_anew():
    preprocessing = CountingPreprocessing()
    images = PendingImages(_request(), preprocessing)
    images.response()
    retried = images.again()
    assert retried.for_link() == (_request(), NAME)  # its own way, as a new request's
    assert retried.response() == "response-2"
    fresh = PendingImages(_request(), preprocessing)
    fresh.delivered()
    assert fresh.request is None and fresh.for_link() is None
    with pytest.raises(RuntimeError, match="delivered"):
        fresh.response()


def test_urls_too_long_for_the_link_go_as_the_ingress_s_own_call():
    preprocessing = CountingPreprocessing()
    prefix = "data:image/png;base64,"
    at_limit = ImageBatchRequest([prefix + "A" * (LINK_MAX_URL_CHARS - len(prefix))], PixelMode.DEVICE_NORMALIZE, "bfloat16")
    assert PendingImages(at_limit, preprocessing).for_link() == (at_limit, NAME)
    over = ImageBatchRequest([prefix + "A" * 1000] * 2 + [prefix + "A" * (LINK_MAX_URL_CHARS - 2000)], PixelMode.DEVICE_NORMALIZE, "bfloat16")
    images = PendingImages(over, preprocessing)
    assert images.for_link() is None
    assert images.response() == "response-1"
