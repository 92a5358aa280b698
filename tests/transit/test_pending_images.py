"""`PendingImages`: a request's images go to the engine client as their URLs and the preprocessor's
name, for each of its choices under one group, and nothing is kept once every choice was delivered."""

from __future__ import annotations

import pytest

from mmserve.multimodal import ImageBatchRequest
from mmserve.multimodal.types import PixelMode
from mmserve.openai.parallel_sampling import child_request
from mmserve.transit.pending_images import PendingImages
from mmserve.transit.engine_link import ImageRequest, PreprocessorName
from mmserve.wire import SamplingParams

NAME = PreprocessorName("app", "Preprocessor", "v1")
IMAGES = ImageBatchRequest(urls=["data:image/png;base64,AAAA"], pixel_mode=PixelMode.DEVICE_NORMALIZE, engine_dtype="bfloat16")


def _choice(index: int, n: int):
    return child_request("chatcmpl-1", [1, 2, 3], SamplingParams(), n, index, 0.0)


def test_each_choice_goes_as_an_image_request_naming_the_images_the_preprocessor_and_the_group():
    images = PendingImages(IMAGES, NAME, group="chatcmpl-1", choices=2)
    sent = [images.message("caller", _choice(i, 2)) for i in range(2)]
    assert sent == [ImageRequest("caller", _choice(i, 2), IMAGES, NAME, "chatcmpl-1", 2) for i in range(2)]
    assert PendingImages(IMAGES, NAME).message("caller", _choice(0, 1)).group == ""  # one choice: no group


def test_the_urls_are_dropped_once_every_choice_was_delivered_and_not_before():
    images = PendingImages(IMAGES, NAME, group="chatcmpl-1", choices=2)
    images.delivered()
    assert images.message("caller", _choice(1, 2)).images == IMAGES  # the other choice may still be sent again
    images.delivered()
    assert images.request is None
    with pytest.raises(RuntimeError, match="delivered"):
        images.message("caller", _choice(1, 2))
