"""The engine router's plain class: engine choice, retries before the first output, refusals, limits (no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from mmserve.engine import EngineDeadError, EngineNotReadyError, EngineOverloadedError, InvalidRequestError
from mmserve.multimodal import ImageBatchRequest, PixelMode
from mmserve.multimodal.errors import ImageInputError, ImagesTooLargeError
from mmserve.transit.router import EngineRouter, NoEngineAliveError, PendingImages, StaticEngines
from mmserve.openai.errors import openai_error
from mmserve.transit.engine_link import EngineEvent, EngineInfo, ImageRequest, PreprocessorName
from mmserve.transit.refusals import GatewayBusyError, LinkLost, Refusal, refusal_error
from mmserve.wire import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from tests.support.defaults import routing_settings


def _request(request_id: str = "r") -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2], None, SamplingParams(max_tokens=2), None, 0.0, None, None, None)


class FakeCall:
    def __init__(self, events: list, fail: BaseException | None) -> None:
        self.events, self.fail, self.cancelled = events, fail, False

    async def __aiter__(self):
        for event in self.events:
            yield event
        if self.fail is not None:
            raise self.fail

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    """An engine connection whose calls play a script: events, then optionally a failure."""

    def __init__(self, state: str = "ready", events=None, fail: BaseException | None = None, builtin: bool = True) -> None:
        self.state, self.builtin = state, builtin
        self.events = events if events is not None else [EngineEvent(outputs=[EngineCoreOutput("r", [5], finish_reason=FinishReason.LENGTH)])]
        self.fail = fail
        self.calls: list[FakeCall] = []
        self.images: list[object] = []

    async def info(self) -> EngineInfo:
        return EngineInfo(state=self.state, builtin=self.builtin, handshake_address="tcp://x:1", max_model_len=64, dtype="float32",
                          death_reason="boom" if self.state == "dead" else None)

    def close(self) -> None:
        pass

    def generate(self, request, images):
        self.images.append(images.message("caller", request) if images is not None else None)  # as the link sends it
        call = FakeCall(self.events, self.fail)
        self.calls.append(call)
        return call


PREPROCESSOR = PreprocessorName("app", "Preprocessor")


def _router(engines, preprocessor=None, wait_timeout_s=0.0) -> EngineRouter:
    return EngineRouter([StaticEngines(engines)], preprocessor=preprocessor, wait_timeout_s=wait_timeout_s, refresh_interval_s=0.0, routing=routing_settings())


def _collect(router: EngineRouter, images=None) -> list[EngineEvent]:
    async def run():
        return [event async for event in router.generate(_request(), images)]

    return asyncio.run(run())


def test_limits_come_from_a_ready_engines_handshake():
    limits = asyncio.run(_router([FakeEngine("starting"), FakeEngine(builtin=False)]).limits())
    assert (limits.max_model_len, limits.engine_kind, limits.dtype) == (64, "vllm", "float32")


def test_no_ready_engine_is_not_ready_and_all_dead_is_no_engine_alive():
    with pytest.raises(EngineNotReadyError):
        asyncio.run(_router([FakeEngine("starting")]).limits(wait=False))
    with pytest.raises(EngineNotReadyError):
        asyncio.run(_router([FakeEngine("starting"), FakeEngine("dead")]).limits())
    with pytest.raises(NoEngineAliveError, match="boom"):
        asyncio.run(_router([FakeEngine("dead")]).limits())


def test_an_engine_dead_before_its_first_output_hands_the_request_to_another():
    dead, good = FakeEngine(events=[], fail=EngineDeadError("gone")), FakeEngine()
    events = _collect(_router([dead, good]))
    assert [o.new_token_ids for e in events for o in e.outputs] == [[5]]
    assert len(dead.calls) == 1 and dead.calls[0].cancelled and len(good.calls) == 1


def test_a_failure_after_output_is_not_retried():
    first = FakeEngine(fail=EngineDeadError("gone"))
    other = FakeEngine()
    with pytest.raises(EngineDeadError):
        _collect(_router([first, other]))
    assert (len(first.calls), other.calls) == (1, [])  # produced output: never sent elsewhere
    lost = FakeEngine(fail=LinkLost("actor died"))
    with pytest.raises(EngineDeadError, match="actor died"):
        _collect(_router([lost]))


def test_a_request_lost_before_its_first_output_goes_once_more_its_images_with_it():
    engine = FakeEngine(events=[], fail=LinkLost("engine client died"))
    router = _router([engine], PREPROCESSOR)
    batch = ImageBatchRequest(urls=["data:x"], pixel_mode=PixelMode("device_normalize"), engine_dtype="float32")
    images = router.preprocess(batch)
    assert isinstance(images, PendingImages)
    with pytest.raises(GatewayBusyError, match="was lost: engine client died"):
        _collect(router, images)
    assert engine.images == [ImageRequest("caller", _request(), batch, PREPROCESSOR)] * 2
    # Lost once: the second try, on the same engine (its engine client's replacement), answers.
    events = _collect(_router([_Once(FakeEngine(events=[], fail=LinkLost("lost on the way")), FakeEngine())]))
    assert [o.new_token_ids for e in events for o in e.outputs] == [[5]]


class _Once:
    """One engine whose first call fails as `first` does, and whose later ones answer as `then` does."""

    def __init__(self, first: FakeEngine, then: FakeEngine) -> None:
        self.first, self.then, self.calls = first, then, 0

    async def info(self):
        return await self.then.info()

    def close(self) -> None:
        pass

    def generate(self, request, images):
        self.calls += 1
        return (self.first if self.calls == 1 else self.then).generate(request, images)


@pytest.mark.parametrize(
    ("refusal", "error"),
    [
        (Refusal("image", "image 1: not an image", "messages"), ImageInputError),
        (Refusal("image_too_large", "image 1: too many pixels", "messages"), ImagesTooLargeError),
        (Refusal("busy", "decoding other images", "messages", retry_after_s=1), GatewayBusyError),
        (Refusal("overloaded", "full"), EngineOverloadedError),
        (Refusal("invalid", "too long", "max_tokens"), InvalidRequestError),
        (Refusal("internal", "a bug"), RuntimeError),
    ],
)
def test_refusals_become_typed_errors_and_are_not_retried(refusal, error):
    first, second = FakeEngine(events=[EngineEvent(refused=refusal)]), FakeEngine()
    with pytest.raises(error):
        _collect(_router([first, second]))
    assert len(first.calls) + len(second.calls) == 1


@pytest.mark.parametrize(
    ("refusal", "status", "retry_after"),
    [
        (Refusal("image", "image 1: not an image", "messages"), 400, None),
        (Refusal("image_too_large", "image 1: too many pixels", "messages"), 413, None),
        (Refusal("busy", "decoding other images", "messages", retry_after_s=2), 503, 2),
    ],
)
def test_image_refusals_reach_the_client_with_their_status(refusal, status, retry_after):
    mapped = openai_error(refusal_error(refusal))
    assert (mapped.status, mapped.retry_after_s, mapped.message) == (status, retry_after, refusal.message)


def test_the_least_loaded_ready_engine_wins():
    engines = [FakeEngine("starting"), FakeEngine(), FakeEngine()]
    router = _router(engines)
    router._engines["1"].in_flight = 3  # requests of this router already on engine 1
    _collect(router)
    assert (len(engines[1].calls), len(engines[2].calls)) == (0, 1)


def test_images_without_a_preprocessor_are_refused():
    with pytest.raises(InvalidRequestError):
        _router([FakeEngine()]).preprocess(ImageBatchRequest(urls=["data:x"], pixel_mode=PixelMode("device_normalize"), engine_dtype="float32"))


class Pool:
    """An engine source whose engines come and go, as a pool's replicas do."""

    def __init__(self, **engines) -> None:
        self.listed = dict(engines)

    def engines(self):
        return self.listed


class SlowCall:
    """A call that streams its one output when the test says so."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = False

    async def __aiter__(self):
        await self.release.wait()
        yield EngineEvent(outputs=[EngineCoreOutput("r", [5], finish_reason=FinishReason.LENGTH)])

    def cancel(self) -> None:
        self.cancelled = True


class PoolEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        self.slow: list[SlowCall] = []

    def close(self) -> None:
        self.closed = True

    def generate(self, request, images):
        call = SlowCall()
        self.slow.append(call)
        return call


def test_engines_that_join_a_pool_are_routed_to_and_one_that_leaves_is_drained_then_closed():
    """A pool's engine that leaves gets no new request, keeps its running ones, and is closed (which
    lets its replica stop) only once they have finished; an engine that joins is routed to."""

    async def run():
        first, second = PoolEngine(), PoolEngine()
        pool = Pool(a=first)
        router = EngineRouter([pool], wait_timeout_s=0.0, refresh_interval_s=0.0, routing=routing_settings(affinity=False))

        async def send(request_id):
            return [event async for event in router.generate(_request(request_id))]

        running = asyncio.create_task(send("r1"))
        await asyncio.sleep(0.01)
        assert len(first.slow) == 1
        pool.listed = {"a": first, "b": second}  # a second engine joins
        joined = asyncio.create_task(send("r2"))
        await asyncio.sleep(0.01)
        assert len(second.slow) == 1  # the least loaded: the new one
        pool.listed = {"b": second}  # the first leaves with r1 still running
        assert list(await router.infos()) == ["b"]
        later = asyncio.create_task(send("r3"))
        await asyncio.sleep(0.01)
        assert (len(first.slow), len(second.slow)) == (1, 2)  # nothing new for the leaving engine
        assert not first.closed  # r1 still runs there
        first.slow[0].release.set()
        assert len(await running) == 1  # r1 finished whole
        assert first.closed  # then its connection is closed
        for call in second.slow:
            call.release.set()
        await asyncio.gather(joined, later)
        assert not second.closed

    asyncio.run(run())
