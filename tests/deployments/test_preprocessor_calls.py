"""`PreprocessorCalls`: an engine client's call to the preprocessor answers pixels or a refusal the
client can act on, tries a lost replica's work once more, and lets the preprocessor's own bugs through."""

from __future__ import annotations

import asyncio
import logging

import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError

from deployments.preprocessor_calls import PreprocessorCalls
from mmserve.multimodal import ImageBatchRequest, ImagesRefused, ProcessedImages
from mmserve.multimodal.types import PixelMode
from mmserve.protocol import PreprocessorName

NAME = PreprocessorName("app", "Preprocessor")
REQUEST = ImageBatchRequest(urls=["data:image/png;base64,AAAA"], pixel_mode=PixelMode.DEVICE_NORMALIZE, engine_dtype="bfloat16")
PROCESSED = ProcessedImages(images=[], placeholder_token_id=7, family="qwen2_vl")


class ScriptedResponse:
    """A Serve response's stand-in: awaited, it gives `answer` (raised if an exception; never, if None)."""

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.cancelled = False

    def __await__(self):
        return self._result().__await__()

    async def _result(self):
        if self.answer is None:
            await asyncio.Event().wait()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedPreprocessing:
    """Answers each call with the next of `answers`."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.responses: list[ScriptedResponse] = []

    @property
    def calls(self) -> int:
        return len(self.responses)

    def process(self, request: ImageBatchRequest) -> ScriptedResponse:
        self.responses.append(ScriptedResponse(self.answers.pop(0)))
        return self.responses[-1]


def _calls(preprocessing: ScriptedPreprocessing) -> PreprocessorCalls:
    calls = PreprocessorCalls()
    calls._handles[NAME] = preprocessing  # type: ignore[assignment]  # (a Serve handle's stand-in)
    return calls


def _process(preprocessing: ScriptedPreprocessing):
    return asyncio.run(_calls(preprocessing).process(REQUEST, NAME))


def test_the_pixels_and_the_preprocessors_own_refusals_come_back_as_answered():
    assert _process(ScriptedPreprocessing(PROCESSED)) is PROCESSED
    refused = ImagesRefused("image 1: not an image", 0)
    assert _process(ScriptedPreprocessing(refused)) is refused


def test_a_replica_lost_under_the_call_is_tried_once_more(caplog):
    preprocessing = ScriptedPreprocessing(ActorDiedError(), PROCESSED)
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        assert _process(preprocessing) is PROCESSED
    assert preprocessing.calls == 2
    assert "trying once more" in caplog.text


def test_a_second_loss_or_a_full_queue_is_busy_for_the_client():
    twice = ScriptedPreprocessing(ActorDiedError(), ActorDiedError())
    refused = _process(twice)
    assert isinstance(refused, ImagesRefused) and refused.kind == "busy" and refused.retry_after_s == 1
    assert "image preprocessing failed" in refused.message and twice.calls == 2
    full = ScriptedPreprocessing(BackPressureError(num_queued_requests=4, max_queued_requests=4))
    refused = _process(full)
    assert isinstance(refused, ImagesRefused) and refused.kind == "busy" and "queue is full" in refused.message
    assert full.calls == 1


def test_a_bug_in_the_preprocessor_is_raised_as_itself_and_not_retried():
    bug = ValueError("a bug")
    preprocessing = ScriptedPreprocessing(RayTaskError("process", "Traceback ...", bug))
    with pytest.raises(ValueError, match="a bug"):
        _process(preprocessing)
    assert preprocessing.calls == 1


def test_a_cancelled_caller_cancels_the_call_itself():
    """(Awaiting a Serve response only stops waiting for it: the call must be cancelled too, or
    the preprocessor goes on fetching and decoding for a request nobody waits for.)"""
    preprocessing = ScriptedPreprocessing(None)

    async def run():
        task = asyncio.ensure_future(_calls(preprocessing).process(REQUEST, NAME))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert preprocessing.responses[0].cancelled


class ScriptedReplicas:
    """`PreprocessorReplicas`' stand-in: each job gets the next of `answers` (raised if an exception)."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.jobs = 0

    async def process(self, request: ImageBatchRequest):
        self.jobs += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class ScriptedLinks:
    def __init__(self, replicas: ScriptedReplicas) -> None:
        self.replicas = replicas


def _linked_calls(replicas: ScriptedReplicas, preprocessing: ScriptedPreprocessing) -> PreprocessorCalls:
    calls = PreprocessorCalls(host="127.0.0.1")
    calls._links[(NAME.app, NAME.deployment)] = ScriptedLinks(replicas)  # type: ignore[assignment]
    calls._handles[NAME] = preprocessing  # type: ignore[assignment]
    return calls


def test_over_the_link_a_lost_replicas_job_is_tried_once_more_then_busy(caplog):
    from mmserve.multimodal.preprocessing_client import ReplicaLost

    calls = _linked_calls(ScriptedReplicas(ReplicaLost("r1 lost"), PROCESSED), serve := ScriptedPreprocessing())
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        assert asyncio.run(calls.process(REQUEST, NAME)) is PROCESSED
    assert "trying once more" in caplog.text and calls.over_link == 1 and serve.calls == 0
    twice = _linked_calls(ScriptedReplicas(ReplicaLost("r1 lost"), ReplicaLost("r2 lost")), ScriptedPreprocessing())
    refused = asyncio.run(twice.process(REQUEST, NAME))
    assert isinstance(refused, ImagesRefused) and refused.kind == "busy" and "r2 lost" in refused.message


def test_with_no_replica_attached_yet_the_call_goes_through_serve():
    from mmserve.multimodal.preprocessing_client import NoReplicaAttached

    calls = _linked_calls(replicas := ScriptedReplicas(NoReplicaAttached()), serve := ScriptedPreprocessing(PROCESSED))
    assert asyncio.run(calls.process(REQUEST, NAME)) is PROCESSED
    assert replicas.jobs == 1 and serve.calls == 1 and calls.over_link == 0
