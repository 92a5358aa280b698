"""`LinkImages`: the choices of an `n` > 1 request share one processing, however late one of them comes."""

from __future__ import annotations

import asyncio

import pytest

from deployments import link_images
from deployments.link_images import LinkImages
from mmserve.multimodal import ImageBatchRequest, PixelMode, ProcessedImages
from mmserve.openai.parallel_sampling import child_request
from mmserve.transit.engine_link import PreprocessorName
from mmserve.transit.pending_images import PendingImages
from mmserve.wire import SamplingParams

NAME = PreprocessorName("app", "Preprocessor", "v1")
# Not a data URI: never recalled, every request's images are processed.
IMAGES = ImageBatchRequest(urls=["https://example.com/a.png"], pixel_mode=PixelMode.DEVICE_NORMALIZE, engine_dtype="bfloat16")


class _Preprocessors:
    """Counts the jobs; each ends when the test says."""

    def __init__(self) -> None:
        self.jobs = 0
        self.ends: list[asyncio.Future[ProcessedImages]] = []

    async def process(self, request, name):
        self.jobs += 1
        self.ends.append(asyncio.get_running_loop().create_future())
        return await self.ends[-1]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _images(processor: _Preprocessors) -> LinkImages:
    images = LinkImages(lambda hashes: False, "127.0.0.1", attach_timeout_s=1.0)
    images._preprocessors = processor
    return images


def _messages(n: int, request_id: str = "chatcmpl-1"):
    pending = PendingImages(IMAGES, NAME, group=request_id if n > 1 else "", choices=n)
    return [pending.message("caller", child_request(request_id, [1, 2], SamplingParams(), n, i, 0.0)) for i in range(n)]


async def test_a_choice_that_comes_after_its_group_was_processed_gets_the_same_images():
    processor = _Preprocessors()
    images = _images(processor)
    first, second = _messages(2)
    task = asyncio.ensure_future(images.process(first))
    await _settle()
    result = ProcessedImages(images=[], placeholder_token_id=1, family="qwen2_vl")
    processor.ends[0].set_result(result)
    assert await task is result
    assert await asyncio.wait_for(images.process(second), 1.0) is result  # after the first one's processing ended
    assert processor.jobs == 1
    assert not images._groups  # every choice came: nothing held


async def test_choices_in_flight_together_share_one_job_and_a_request_without_group_has_its_own():
    processor = _Preprocessors()
    images = _images(processor)
    tasks = [asyncio.ensure_future(images.process(message)) for message in _messages(3) + _messages(1, "chatcmpl-2")]
    await _settle()
    assert processor.jobs == 2
    for end in processor.ends:
        end.set_result(ProcessedImages(images=[], placeholder_token_id=1, family="qwen2_vl"))
    results = await asyncio.gather(*tasks)
    assert results[0] is results[1] is results[2] is not results[3]


async def test_a_group_whose_other_choices_never_come_is_let_go(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(link_images, "GROUP_HOLD_S", 0.05)
    processor = _Preprocessors()
    images = _images(processor)
    first, second = _messages(2)
    task = asyncio.ensure_future(images.process(first))
    await _settle()
    processor.ends[0].set_result(ProcessedImages(images=[], placeholder_token_id=1, family="qwen2_vl"))
    await task
    assert images._groups
    await asyncio.sleep(0.1)
    assert not images._groups  # the other choice went elsewhere: its pixels are not kept
    task = asyncio.ensure_future(images.process(second))
    await _settle()
    assert processor.jobs == 2
    processor.ends[1].set_result(ProcessedImages(images=[], placeholder_token_id=1, family="qwen2_vl"))
    await task


async def test_a_group_whose_choices_were_all_cancelled_is_processed_again_for_the_next():
    processor = _Preprocessors()
    images = _images(processor)
    first, second = _messages(2)
    task = asyncio.ensure_future(images.process(first))
    await _settle()
    images.cancel("caller", first.request.request_id)
    assert await task is None
    assert processor.ends[0].cancelled()
    task = asyncio.ensure_future(images.process(second))
    await _settle()
    assert processor.jobs == 2
    processor.ends[1].set_result(ProcessedImages(images=[], placeholder_token_id=1, family="qwen2_vl"))
    assert isinstance(await task, ProcessedImages)
