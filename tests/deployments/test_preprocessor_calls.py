"""`PreprocessorCalls`: an engine client's call to the preprocessor answers pixels or a refusal the
client can act on, and tries a job lost on the way, or with its replica, once more."""

from __future__ import annotations

import asyncio
import logging

from deployments.preprocessor_calls import PreprocessorCalls
from mmserve.multimodal import ImageBatchRequest, ProcessedImages
from mmserve.multimodal.types import PixelMode
from mmserve.transit.engine_link import PreprocessorName
from mmserve.transit.refusals import LinkLost, Refusal

NAME = PreprocessorName("app", "Preprocessor")
REQUEST = ImageBatchRequest(urls=["data:image/png;base64,AAAA"], pixel_mode=PixelMode.DEVICE_NORMALIZE, engine_dtype="bfloat16")
PROCESSED = ProcessedImages(images=[], placeholder_token_id=7, family="qwen2_vl")


class ScriptedReplicas:
    """`PreprocessorReplicas`' stand-in: each job gets the next of `answers` (raised if an exception)."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.jobs: list[float] = []

    async def process(self, request: ImageBatchRequest, attach_timeout_s: float):
        self.jobs.append(attach_timeout_s)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class ScriptedLinks:
    def __init__(self, replicas: ScriptedReplicas) -> None:
        self.replicas = replicas


def _process(replicas: ScriptedReplicas):
    calls = PreprocessorCalls("127.0.0.1", store=None, attach_timeout_s=7.0)  # type: ignore[arg-type]
    calls._links[(NAME.app, NAME.deployment)] = ScriptedLinks(replicas)  # type: ignore[assignment]
    return asyncio.run(calls.process(REQUEST, NAME)), calls.jobs


def test_the_pixels_and_the_preprocessors_own_refusals_come_back_as_answered():
    assert _process(ScriptedReplicas(PROCESSED)) == (PROCESSED, 1)
    refused = Refusal("image", "image 1: not an image", "messages")
    assert _process(ScriptedReplicas(refused)) == (refused, 1)


def test_a_lost_job_is_tried_once_more_then_refused_as_lost(caplog):
    replicas = ScriptedReplicas(LinkLost("r1 lost"), PROCESSED)
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        assert _process(replicas) == (PROCESSED, 2)
    assert "trying once more" in caplog.text and replicas.jobs == [7.0, 7.0]
    refused, jobs = _process(ScriptedReplicas(LinkLost("r1 lost"), LinkLost("r2 lost")))
    assert (refused.kind, refused.retry_after_s, jobs) == ("lost", 1, 2) and "r2 lost" in refused.message
