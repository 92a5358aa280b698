"""`PreprocessorCalls`: an engine client's call to the preprocessor answers pixels or a refusal the
client can act on, waits for a replica to be attached (bounded), and tries a lost replica's work once more."""

from __future__ import annotations

import asyncio
import logging

from deployments.preprocessor_calls import PreprocessorCalls
from mmserve.multimodal import ImageBatchRequest, ImagesRefused, ProcessedImages
from mmserve.transit.preprocessing_client import NoReplicaAttached, ReplicaLost
from mmserve.multimodal.types import PixelMode
from mmserve.transit.engine_link import PreprocessorName

NAME = PreprocessorName("app", "Preprocessor")
REQUEST = ImageBatchRequest(urls=["data:image/png;base64,AAAA"], pixel_mode=PixelMode.DEVICE_NORMALIZE, engine_dtype="bfloat16")
PROCESSED = ProcessedImages(images=[], placeholder_token_id=7, family="qwen2_vl")


class ScriptedReplicas:
    """`PreprocessorReplicas`' stand-in: each job gets the next of `answers` (raised if an exception);
    attached once `open` is set."""

    def __init__(self, *answers: object, attached: bool = True) -> None:
        self.answers = list(answers)
        self.jobs = 0
        self.open = asyncio.Event()
        if attached:
            self.open.set()

    async def attached(self) -> None:
        await self.open.wait()

    async def process(self, request: ImageBatchRequest):
        self.jobs += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class ScriptedLinks:
    def __init__(self, replicas: ScriptedReplicas) -> None:
        self.replicas = replicas


def _calls(replicas: ScriptedReplicas, attach_timeout_s: float = 5.0) -> PreprocessorCalls:
    calls = PreprocessorCalls("127.0.0.1", store=None, attach_timeout_s=attach_timeout_s)  # type: ignore[arg-type]
    calls._links[(NAME.app, NAME.deployment)] = ScriptedLinks(replicas)  # type: ignore[assignment]
    return calls


def _process(replicas: ScriptedReplicas, attach_timeout_s: float = 5.0):
    return asyncio.run(_calls(replicas, attach_timeout_s).process(REQUEST, NAME))


def test_the_pixels_and_the_preprocessors_own_refusals_come_back_as_answered():
    assert _process(ScriptedReplicas(PROCESSED)) is PROCESSED
    refused = ImagesRefused("image 1: not an image", 0)
    assert _process(ScriptedReplicas(refused)) is refused


def test_a_lost_replicas_job_is_tried_once_more_then_busy(caplog):
    replicas = ScriptedReplicas(ReplicaLost("r1 lost"), PROCESSED)
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        assert _process(replicas) is PROCESSED
    assert "trying once more" in caplog.text and replicas.jobs == 2
    refused = _process(ScriptedReplicas(ReplicaLost("r1 lost"), ReplicaLost("r2 lost")))
    assert isinstance(refused, ImagesRefused) and refused.kind == "busy" and refused.retry_after_s == 1
    assert "r2 lost" in refused.message


def test_a_request_waits_for_a_replica_to_attach_and_is_busy_if_none_does_in_time():
    async def scenario():
        replicas = ScriptedReplicas(PROCESSED, attached=False)
        call = asyncio.ensure_future(_calls(replicas).process(REQUEST, NAME))
        await asyncio.sleep(0.1)
        assert not call.done() and replicas.jobs == 0
        replicas.open.set()
        assert await asyncio.wait_for(call, 5) is PROCESSED

    asyncio.run(scenario())
    refused = _process(ScriptedReplicas(attached=False), attach_timeout_s=0.1)
    assert isinstance(refused, ImagesRefused) and refused.kind == "busy" and "could be reached" in refused.message


def test_a_replica_leaving_as_the_job_came_means_waiting_for_the_next():
    replicas = ScriptedReplicas(NoReplicaAttached(), PROCESSED)
    assert _process(replicas) is PROCESSED and replicas.jobs == 2
