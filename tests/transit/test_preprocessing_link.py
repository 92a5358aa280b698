"""The preprocessing link without Ray: an engine client's `PreprocessorReplicas` and `PreprocessingInbox`
against real `PreprocessingServer`s over ZMQ on this host, pixels through an in-memory store; jobs
answered, cancelled, spread, and failed or finished when a replica is lost or leaves; a message lost
either way found by its number, a lost last one by a probe; every answer's pixels let go once the
engine client has them, or never needs them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from mmserve.multimodal import ImageBatchRequest, ImageField, ProcessedImage, ProcessedImages
from mmserve.multimodal.types import PixelMode
from mmserve.transit.preprocessing_client import PreprocessingInbox, PreprocessorReplicas
from mmserve.transit.preprocessing_link import (
    STORE_MIN_BYTES, AnswerError, JobAnswer, PreprocessJob, answer_of, decode_answer, decode_head, encode,
)
from mmserve.transit.preprocessing_server import PreprocessingServer
from mmserve.transit.refusals import LinkLost, Refusal
from mmserve.transit.sockets import LinkOutbox

HOST = "127.0.0.1"
ATTACH_S = 5.0


def _request(url: str) -> ImageBatchRequest:
    return ImageBatchRequest(urls=[url], pixel_mode=PixelMode.DEVICE_NORMALIZE, engine_dtype="bfloat16")


def _images(seed: int) -> ProcessedImages:
    pixels = np.random.default_rng(seed).integers(0, 2**16, (1564, 1176), dtype=np.uint16)  # a 640×480 image's
    grid = np.array([[1, 34, 46]], dtype=np.int64)
    fields = [ImageField("pixel_values", pixels, "bfloat16", "flat"), ImageField("image_grid_thw", grid, "int64", "batched")]
    return ProcessedImages([ProcessedImage(fields, 391, f"hash{seed}", 640, 480)], placeholder_token_id=7, family="qwen2_vl")


class MemoryStore:
    """The pixel store in this process: what was put, by name, while held; what was read."""

    def __init__(self) -> None:
        self.objects: dict[bytes, list[np.ndarray]] = {}
        self.puts = 0

    def put(self, arrays: list[np.ndarray]) -> tuple[bytes, object]:
        self.puts += 1
        name = str(self.puts).encode()
        self.objects[name] = list(arrays)
        return name, _Hold(self, name)

    async def get(self, name: bytes) -> list[np.ndarray]:
        if name not in self.objects:
            raise LinkLost(f"no object {name!r}")
        return [array.view() for array in self.objects[name]]


class _Hold:
    """The writer's hold: the object goes when nobody keeps this."""

    def __init__(self, store: MemoryStore, name: bytes) -> None:
        self.store, self.name = store, name

    def __del__(self) -> None:
        self.store.objects.pop(self.name, None)


def _encoded(job: int, answer, store) -> tuple[bytes, object]:
    message, hold = answer_of("replica-inbox", job, answer, store.put)
    return encode(message), hold


def test_an_answer_names_its_large_arrays_in_the_store_and_carries_the_small_ones():
    store = MemoryStore()
    images = _images(1)
    data, hold = _encoded(5, images, store)
    [stored] = store.objects.values()
    assert len(stored) == 1 and stored[0] is images.images[0].fields[0].array  # written from the array itself
    assert len(data) < STORE_MIN_BYTES  # the pixels are not in the message
    head = decode_head(data)
    assert (head.sender, head.job, head.pixels) == ("replica-inbox", 5, hold.name)
    got = decode_answer(data, stored).answer.images[0].fields
    assert all(np.array_equal(a.array, b.array) and a.array.dtype == b.array.dtype for a, b in zip(got, images.images[0].fields))
    assert got[0].array is stored[0]  # the store's memory, not a copy of it
    assert not got[1].array.flags.writeable  # (the grid, read out of the message)
    refused = Refusal("image", "image 1: not an image", "messages")
    data, hold = _encoded(6, refused, store)
    assert hold is None and decode_head(data).pixels is None and decode_answer(data).answer == refused
    small = ProcessedImages([ProcessedImage([ImageField("image_grid_thw", np.ones((1, 3), np.int64), "int64", "batched")], 1, "h", 1, 1)], 7, "f")
    data, hold = _encoded(7, small, store)
    assert hold is None and store.puts == 1  # nothing large: nothing stored
    assert np.array_equal(decode_answer(data).answer.images[0].fields[0].array, np.ones((1, 3), np.int64))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x82\xa6sender\xa1x\xa3job\x01"], ids=["empty", "not-msgpack", "neither-answer"])
def test_messages_that_make_no_answer_are_refused_as_such(data):
    with pytest.raises(AnswerError):
        decode_answer(data).answer


def test_an_answer_naming_a_missing_stored_array_or_one_of_another_shape_is_refused():
    store = MemoryStore()
    data, _ = _encoded(1, _images(2), store)
    for bad in ([], [np.zeros((3,), np.uint16)]):
        with pytest.raises(AnswerError):
            decode_answer(data, bad)


class Replica:
    """A preprocessor replica's link end whose work is `work(request)`; records what it started and
    what was cancelled."""

    def __init__(self, work: Callable[[ImageBatchRequest], Awaitable[ProcessedImages | Refusal]], store: MemoryStore) -> None:
        self.work = work
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.server = PreprocessingServer(self._process, HOST, store)

    async def _process(self, request: ImageBatchRequest) -> ProcessedImages | Refusal:
        self.started.append(request.urls[0])
        try:
            return await self.work(request)
        except asyncio.CancelledError:
            self.cancelled.append(request.urls[0])
            raise


@contextlib.asynccontextmanager
async def _linked(*works: Callable[[ImageBatchRequest], Awaitable[ProcessedImages | Refusal]], detached=None,
                  probe_s: float = 10.0):
    """Replicas doing `works`, attached as "r1", "r2", ... to an engine client's end, one store for
    all; all closed after."""
    store = MemoryStore()
    inbox = PreprocessingInbox(HOST, store)
    replicas = PreprocessorReplicas(inbox, detached=detached or (lambda name: None), probe_s=probe_s)
    servers = [Replica(work, store) for work in works]
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
        return Refusal("image", "image 1: no", "messages") if request.urls[0] == "no" else _images(int(request.urls[0]))

    async def scenario():
        async with _linked(seeded_or_no) as (replicas, [replica], inbox):
            answers = await asyncio.gather(*(replicas.process(_request(str(seed)), ATTACH_S) for seed in range(5)))
            for seed, answer in enumerate(answers):
                assert np.array_equal(answer.images[0].fields[0].array, _images(seed).images[0].fields[0].array)
            assert await replicas.process(_request("no"), ATTACH_S) == Refusal("image", "image 1: no", "messages")
            assert replica.server.in_flight == 0
            # Each answer's pixels were let go once the engine client had them (its arrays keep their memory).
            await _until(lambda: replica.server.pixels_held == 0)
            assert inbox.store.puts == 5 and not inbox.store.objects

    _run(scenario)


def test_a_cancelled_job_is_cancelled_at_the_replica():
    async def scenario():
        async with _linked(_forever) as (replicas, [replica], _):
            job = asyncio.ensure_future(replicas.process(_request("u1"), ATTACH_S))
            await _until(lambda: replica.started == ["u1"])
            job.cancel()
            await _until(lambda: replica.cancelled == ["u1"])
            assert replica.server.in_flight == 0

    _run(scenario)


def test_jobs_go_to_the_replica_with_fewest_and_a_lost_replicas_jobs_fail_as_lost():
    async def scenario():
        async with _linked(_forever, _forever) as (replicas, [first, second], _):
            jobs = [asyncio.ensure_future(replicas.process(_request(f"u{i}"), ATTACH_S)) for i in range(4)]
            await _until(lambda: len(first.started) + len(second.started) == 4)
            assert len(first.started) == len(second.started) == 2
            replicas.lost("r1")
            done, pending = await asyncio.wait(jobs, timeout=1)
            assert len(done) == 2 and all(isinstance(job.exception(), LinkLost) for job in done)
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
            job = asyncio.ensure_future(replicas.process(_request("u1"), ATTACH_S))
            await _until(lambda: replica.started == ["u1"])
            replicas.leave("r1")
            # No other replica to send it to: it waits for one, and is busy when none comes in time.
            refused = await replicas.process(_request("u2"), 0.2)
            assert refused.kind == "busy" and "could be reached within" in refused.message and replica.started == ["u1"]
            assert detached == []
            release.set()
            assert isinstance(await job, ProcessedImages)
            assert detached == ["r1"] and "r1" not in replicas

    _run(scenario)


def test_a_detached_senders_jobs_are_cancelled_and_its_later_jobs_dropped():
    async def scenario():
        async with _linked(_forever) as (replicas, [replica], inbox):
            job = asyncio.ensure_future(replicas.process(_request("u1"), ATTACH_S))
            await _until(lambda: replica.started == ["u1"])
            replica.server.detach(inbox.address)  # (its Serve call ended: the engine client is gone)
            await _until(lambda: replica.cancelled == ["u1"])
            later = asyncio.ensure_future(replicas.process(_request("u2"), ATTACH_S))
            await asyncio.sleep(0.3)
            assert replica.started == ["u1"] and replica.server.in_flight == 0
            job.cancel()
            later.cancel()

    _run(scenario)


def test_an_answer_for_a_sender_whose_inbox_is_gone_is_dropped_not_kept(monkeypatch, caplog):
    import mmserve.transit.preprocessing_server as server_module

    monkeypatch.setattr(server_module, "UNDELIVERED_TRIES", 4)

    async def scenario():
        release = asyncio.Event()

        async def held(request: ImageBatchRequest):
            await release.wait()
            return _images(1)

        async with _linked(held) as (replicas, [replica], inbox):
            job = asyncio.ensure_future(replicas.process(_request("u1"), ATTACH_S))
            await _until(lambda: replica.started == ["u1"])
            inbox.close()  # the engine client's process is gone: its inbox's connection with it
            await asyncio.sleep(0.3)
            release.set()
            await _until(lambda: "could not be delivered" in caplog.text)
            assert replica.server.in_flight == 0
            job.cancel()

    with caplog.at_level("WARNING", logger="ray.serve"):
        _run(scenario)


def _losing(outbox: LinkOutbox, lose: Callable[[object], bool]) -> None:
    """Make `outbox` lose the messages `lose` picks, as a broken connection would: their numbers go
    unused by anything that arrives."""
    send = outbox.send

    def send_or_lose(message, encode):
        if lose(message):
            outbox.skip()
        else:
            send(message, encode)

    outbox.send = send_or_lose  # type: ignore[method-assign]


def test_a_job_lost_on_the_way_is_found_by_the_next_message_at_the_replica_and_fails_as_lost(caplog):
    async def waits_unless_next(request: ImageBatchRequest):
        if request.urls[0] != "next":
            await asyncio.Event().wait()
        return _images(3)

    async def scenario():
        async with _linked(waits_unless_next) as (replicas, [replica], inbox):
            first = asyncio.ensure_future(replicas.process(_request("before"), ATTACH_S))
            await _until(lambda: replica.started == ["before"])
            replicas._replicas["r1"].outbox.skip()  # a message between the two never arrives
            second = asyncio.ensure_future(replicas.process(_request("after"), ATTACH_S))
            for job in (first, second):  # the replica found the gap, dropped the sender's jobs, and said so
                with pytest.raises(LinkLost, match="were lost"):
                    await asyncio.wait_for(job, 5)
            await _until(lambda: replica.server.in_flight == 0)
            # The link goes on from there.
            assert isinstance(await asyncio.wait_for(replicas.process(_request("next"), ATTACH_S), 5), ProcessedImages)

    with caplog.at_level("WARNING", logger="ray.serve"):
        _run(scenario)
    assert "were lost on the way: dropping its jobs" in caplog.text


def test_a_lost_last_job_or_answer_is_found_by_a_probe_and_a_healthy_wait_goes_on():
    """Nothing follows the lost message: the engine client, waiting with nothing heard, probes; the
    probe's number (at the replica) or its answer's (here) shows the loss. A job merely slow is
    probed too, and waits on."""
    async def seeded(request: ImageBatchRequest):
        if request.urls[0] == "slow":
            await asyncio.sleep(0.8)
        return _images(1)

    async def scenario():
        async with _linked(seeded, probe_s=0.1) as (replicas, [replica], inbox):
            outbox = replicas._replicas["r1"].outbox
            _losing(outbox, lambda message: isinstance(message, PreprocessJob) and message.request.urls[0] == "job-lost")
            with pytest.raises(LinkLost):
                await asyncio.wait_for(replicas.process(_request("job-lost"), ATTACH_S), 5)
            answers = replica.server._senders[inbox.address]
            _losing(answers, lambda message: isinstance(message, JobAnswer) and message.job == 2)  # "answer-lost"'s
            with pytest.raises(LinkLost):
                await asyncio.wait_for(replicas.process(_request("answer-lost"), ATTACH_S), 5)
            slow = await asyncio.wait_for(replicas.process(_request("slow"), ATTACH_S), 5)  # probed 7 times: heard
            assert isinstance(slow, ProcessedImages)
            await _until(lambda: replica.server.pixels_held == 0)  # the lost answer's pixels went with its job

    _run(scenario)


def test_a_job_that_fails_is_answered_as_internal_and_logged_with_its_traceback(caplog):
    async def broken(request: ImageBatchRequest):
        raise RuntimeError("a bug")

    async def scenario():
        async with _linked(broken) as (replicas, _, _):
            answer = await replicas.process(_request("u1"), ATTACH_S)
            assert isinstance(answer, Refusal) and answer.kind == "internal" and "RuntimeError" in answer.message

    with caplog.at_level("ERROR", logger="ray.serve"):
        _run(scenario)
    assert "job 1 failed" in caplog.text and "a bug" in caplog.text


def test_pixels_are_let_go_when_their_job_is_cancelled_as_answered_or_their_sender_leaves():
    """No answer's pixels outlive its request: an answer that crossed its job's cancellation, and every
    answer of a sender that detached, are let go at once, without a release from the engine client."""
    async def scenario():
        release = asyncio.Event()

        async def held(request: ImageBatchRequest):
            await release.wait()
            return _images(int(request.urls[0]))

        async with _linked(held) as (replicas, [replica], inbox):
            store = inbox.store
            # The answer leaves as the job is cancelled: the replica gets the cancellation after answering.
            first = asyncio.ensure_future(replicas.process(_request("1"), ATTACH_S))
            await _until(lambda: replica.started == ["1"])
            replica.server._senders[inbox.address].send = lambda message, encode: None  # (the answer is "on its way")
            release.set()
            await _until(lambda: replica.server.pixels_held == 1)
            first.cancel()
            await _until(lambda: replica.server.pixels_held == 0 and not store.objects)
            # A sender whose answers' pixels are held detaches: they go with it.
            del replica.server._senders[inbox.address].send
            replica.server._held[(inbox.address, 99)] = (store.put([np.zeros(STORE_MIN_BYTES, np.uint8)])[1], 0.0)
            replica.server.detach(inbox.address)
            assert replica.server.pixels_held == 0 and not store.objects

    _run(scenario)


def test_pixels_never_released_are_let_go_after_the_hold_and_reading_them_then_is_a_loss(caplog):
    async def scenario():
        store = MemoryStore()
        server = PreprocessingServer(_forever, HOST, store, pixel_hold_s=0.2)
        inbox = PreprocessingInbox(HOST, store)
        server.attach(inbox.address)
        server._held[(inbox.address, 1)] = (store.put([np.zeros(STORE_MIN_BYTES, np.uint8)])[1], asyncio.get_running_loop().time())
        server._sweeper = asyncio.ensure_future(server._sweep())
        await _until(lambda: server.pixels_held == 0 and not store.objects)
        with pytest.raises(LinkLost):
            await store.get(b"1")
        server.close()
        inbox.close()

    with caplog.at_level("WARNING", logger="ray.serve"):
        _run(scenario)
    assert "not released within" in caplog.text
