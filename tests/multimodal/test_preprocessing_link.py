"""The preprocessing link without Ray: an engine client's `PreprocessorReplicas` and `PreprocessingInbox`
against real `PreprocessingServer`s over ZMQ on this host; pixels as frames, jobs answered, cancelled,
spread, and failed or finished when a replica is lost or leaves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import zmq

from mmserve.multimodal import ImageBatchRequest, ImageField, ImagesRefused, ProcessedImage, ProcessedImages
from mmserve.multimodal.preprocessing_client import NoReplicaAttached, PreprocessingInbox, PreprocessorReplicas, ReplicaLost
from mmserve.multimodal.preprocessing_link import AnswerFramesError, decode_answer, encode_answer
from mmserve.multimodal.preprocessing_server import PreprocessingServer
from mmserve.multimodal.types import PixelMode
from mmserve.zmq_link import LinkOutbox

HOST = "127.0.0.1"


def _request(url: str) -> ImageBatchRequest:
    return ImageBatchRequest(urls=[url], pixel_mode=PixelMode.DEVICE_NORMALIZE, engine_dtype="bfloat16")


def _images(seed: int) -> ProcessedImages:
    pixels = np.random.default_rng(seed).integers(0, 2**16, (1564, 1176), dtype=np.uint16)  # a 640×480 image's
    grid = np.array([[1, 34, 46]], dtype=np.int64)
    fields = [ImageField("pixel_values", pixels, "bfloat16", "flat"), ImageField("image_grid_thw", grid, "int64", "batched")]
    return ProcessedImages([ProcessedImage(fields, 391, f"hash{seed}", 640, 480)], placeholder_token_id=7, family="qwen2_vl")


def test_an_answer_is_its_header_and_each_arrays_memory_uncopied_both_ways():
    images = _images(1)
    frames = encode_answer(5, images)
    assert len(frames) == 3 and frames[1] is images.images[0].fields[0].array  # sent from the array itself
    received = [zmq.Frame(frame) for frame in frames]  # as the receiving socket hands them over
    answer = decode_answer(received)
    assert answer.job == 5
    got = answer.answer.images[0].fields
    assert all(np.array_equal(a.array, b.array) and a.array.dtype == b.array.dtype for a, b in zip(got, images.images[0].fields))
    # The received array is a read-only view of its frame, not a copy of it.
    assert np.shares_memory(got[0].array, np.frombuffer(received[1].buffer, dtype=np.uint8))
    assert not got[0].array.flags.writeable
    refused = ImagesRefused("image 1: not an image", 0)
    assert decode_answer(encode_answer(6, refused)).answer == refused


@pytest.mark.parametrize("frames", [[], [b"\xc1"], [b"\x81\xa3job\x01"]], ids=["none", "not-msgpack", "neither-answer"])
def test_frames_that_make_no_answer_are_refused_as_such(frames):
    with pytest.raises(AnswerFramesError):
        decode_answer(frames).answer


def test_an_array_naming_a_missing_frame_or_a_size_its_frame_cannot_hold_is_refused():
    frames = encode_answer(1, _images(2))
    for bad in ([frames[0]], [frames[0], b"123", frames[2]]):
        with pytest.raises(AnswerFramesError):
            decode_answer(bad)


class Replica:
    """A preprocessor replica's link end whose work is `work(request)`; records what it started and
    what was cancelled."""

    def __init__(self, work: Callable[[ImageBatchRequest], Awaitable[ProcessedImages | ImagesRefused]]) -> None:
        self.work = work
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.server = PreprocessingServer(self._process, HOST)

    async def _process(self, request: ImageBatchRequest) -> ProcessedImages | ImagesRefused:
        self.started.append(request.urls[0])
        try:
            return await self.work(request)
        except asyncio.CancelledError:
            self.cancelled.append(request.urls[0])
            raise


@contextlib.asynccontextmanager
async def _linked(*works: Callable[[ImageBatchRequest], Awaitable[ProcessedImages | ImagesRefused]], detached=None,
                  job_check_s: float = 10.0):
    """Replicas doing `works`, attached as "r1", "r2", ... to an engine client's end; all closed after."""
    inbox = PreprocessingInbox(HOST)
    replicas = PreprocessorReplicas(inbox, detached=detached or (lambda name: None), job_check_s=job_check_s)
    servers = [Replica(work) for work in works]
    for number, replica in enumerate(servers, 1):
        replica.server.attach(inbox.address)
        replicas.attach(f"r{number}", replica.server.address)
    try:
        yield replicas, servers, inbox
    finally:
        replicas.close()
        for replica in servers:
            replica.server.close()
        inbox.close()


async def _forever(request: ImageBatchRequest) -> ProcessedImages:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_jobs_are_answered_pixels_intact_and_refusals_as_refused():
    async def seeded_or_no(request: ImageBatchRequest):
        return ImagesRefused("image 1: no", 0) if request.urls[0] == "no" else _images(int(request.urls[0]))

    async def scenario():
        async with _linked(seeded_or_no) as (replicas, [replica], _):
            answers = await asyncio.gather(*(replicas.process(_request(str(seed))) for seed in range(5)))
            for seed, answer in enumerate(answers):
                assert np.array_equal(answer.images[0].fields[0].array, _images(seed).images[0].fields[0].array)
            assert await replicas.process(_request("no")) == ImagesRefused("image 1: no", 0)
            assert replica.server.in_flight == 0

    _run(scenario)


def test_a_cancelled_job_is_cancelled_at_the_replica():
    async def scenario():
        async with _linked(_forever) as (replicas, [replica], _):
            job = asyncio.ensure_future(replicas.process(_request("u1")))
            await _until(lambda: replica.started == ["u1"])
            job.cancel()
            await _until(lambda: replica.cancelled == ["u1"])
            assert replica.server.in_flight == 0

    _run(scenario)


def test_jobs_go_to_the_replica_with_fewest_and_a_lost_replicas_jobs_fail_as_lost():
    async def scenario():
        async with _linked(_forever, _forever) as (replicas, [first, second], _):
            jobs = [asyncio.ensure_future(replicas.process(_request(f"u{i}"))) for i in range(4)]
            await _until(lambda: len(first.started) + len(second.started) == 4)
            assert len(first.started) == len(second.started) == 2
            replicas.lost("r1")
            done, pending = await asyncio.wait(jobs, timeout=1)
            assert len(done) == 2 and all(isinstance(job.exception(), ReplicaLost) for job in done)
            assert "r1" not in replicas
            for job in pending:
                job.cancel()

    _run(scenario)


def test_a_leaving_replica_gets_no_new_jobs_and_is_detached_once_its_jobs_answered():
    async def scenario():
        release = asyncio.Event()

        async def held(request: ImageBatchRequest):
            await release.wait()
            return _images(1)

        detached: list[str] = []
        async with _linked(held, detached=detached.append) as (replicas, [replica], _):
            job = asyncio.ensure_future(replicas.process(_request("u1")))
            await _until(lambda: replica.started == ["u1"])
            replicas.leave("r1")
            with pytest.raises(NoReplicaAttached):
                await replicas.process(_request("u2"))
            assert detached == []
            release.set()
            assert isinstance(await job, ProcessedImages)
            assert detached == ["r1"] and "r1" not in replicas

    _run(scenario)


def test_a_detached_senders_jobs_are_cancelled_and_its_later_jobs_dropped():
    async def scenario():
        async with _linked(_forever) as (replicas, [replica], inbox):
            job = asyncio.ensure_future(replicas.process(_request("u1")))
            await _until(lambda: replica.started == ["u1"])
            replica.server.detach(inbox.address)  # (its Serve call ended: the engine client is gone)
            await _until(lambda: replica.cancelled == ["u1"])
            later = asyncio.ensure_future(replicas.process(_request("u2")))
            await asyncio.sleep(0.3)
            assert replica.started == ["u1"] and replica.server.in_flight == 0
            job.cancel()
            later.cancel()

    _run(scenario)


def test_an_answer_for_a_sender_whose_inbox_is_gone_is_dropped_not_kept(monkeypatch, caplog):
    import mmserve.multimodal.preprocessing_server as server_module

    monkeypatch.setattr(server_module, "UNDELIVERED_TRIES", 4)

    async def scenario():
        release = asyncio.Event()

        async def held(request: ImageBatchRequest):
            await release.wait()
            return _images(1)

        async with _linked(held) as (replicas, [replica], inbox):
            job = asyncio.ensure_future(replicas.process(_request("u1")))
            await _until(lambda: replica.started == ["u1"])
            inbox.close()  # the engine client's process is gone: its inbox's connection with it
            await asyncio.sleep(0.3)
            release.set()
            await _until(lambda: "could not be delivered" in caplog.text)
            assert replica.server.in_flight == 0
            job.cancel()

    with caplog.at_level("WARNING", logger="ray.serve"):
        _run(scenario)


def test_a_job_the_replica_does_not_hold_fails_as_lost_and_one_it_holds_waits_on():
    """What a broken connection leaves, made here: the replica ends one job without answering (as if its
    message never arrived, or its answer was dropped undelivered), and the sender, asking after its old
    jobs, learns that this one is held nowhere, while the other, still worked on, waits."""
    async def scenario():
        async with _linked(_forever, job_check_s=0.2) as (replicas, [replica], inbox):
            lost = asyncio.ensure_future(replicas.process(_request("lost")))
            await _until(lambda: replica.started == ["lost"])
            held = asyncio.ensure_future(replicas.process(_request("held")))
            await _until(lambda: replica.started == ["lost", "held"])
            replica.server._jobs.pop((inbox.address, 1)).cancel()  # job 1, "lost": gone, no answer, no CancelJobs
            with pytest.raises(ReplicaLost, match="does not hold job 1"):
                await asyncio.wait_for(lost, 2)
            await asyncio.sleep(0.8)  # asked four more times: held
            assert not held.done() and replica.cancelled == ["lost"]
            held.cancel()
            await _until(lambda: replica.cancelled == ["lost", "held"])

    _run(scenario)


def test_a_job_the_replica_is_still_delivering_counts_as_held():
    """An answer waiting for its sender's inbox to be connected again (`UNDELIVERED_TRIES`) is not lost yet."""
    from mmserve.multimodal.preprocessing_link import AskHeldJobs, decode_answer, encode_message

    async def scenario():
        inbox = PreprocessingInbox(HOST)
        server = PreprocessingServer(_forever, HOST)
        server.attach(inbox.address)
        server._delivering.add((inbox.address, 7))
        outbox = LinkOutbox(server.address)
        outbox.send_nowait(encode_message(AskHeldJobs(inbox.address, [7, 8])))
        frames = await asyncio.wait_for(inbox._inbox.recv_frames(), 5)
        assert decode_answer(frames).not_held == [8]
        outbox.close()
        server.close()
        inbox.close()

    _run(scenario)


def test_a_job_that_fails_is_answered_as_busy_and_logged_with_its_traceback(caplog):
    async def broken(request: ImageBatchRequest):
        raise RuntimeError("a bug")

    async def scenario():
        async with _linked(broken) as (replicas, _, _):
            answer = await replicas.process(_request("u1"))
            assert isinstance(answer, ImagesRefused) and answer.kind == "busy" and "RuntimeError" in answer.message

    with caplog.at_level("ERROR", logger="ray.serve"):
        _run(scenario)
    assert "job 1 failed" in caplog.text and "a bug" in caplog.text
