"""Engine choice by load and cache affinity: the plain router over stand-in engine connections (no Ray)."""

from __future__ import annotations

import asyncio
import random

import pytest

from mmserve.engine import EngineDeadError
from mmserve.multimodal import ImageBatchRequest, PixelMode
from mmserve.transit.affinity import (
    PREFIX_BLOCK_TOKENS, AffinityKeys, AffinityTable, affinity_keys, choose_engine, home_engine, image_key,
)
from mmserve.transit.router import EngineRouter, PendingImages, StaticEngines
from mmserve.transit.engine_link import EngineEvent, EngineInfo
from mmserve.wire import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from tests.support.defaults import routing_settings


def _request(tokens: list[int], request_id: str = "r") -> EngineCoreRequest:
    return EngineCoreRequest(request_id, tokens, None, SamplingParams(max_tokens=2), None, 0.0, None, None, None)


def _images(*urls: str) -> PendingImages:
    return PendingImages(ImageBatchRequest(urls=list(urls), pixel_mode=PixelMode.DEVICE_NORMALIZE, engine_dtype="float32"), NoPreprocessing())


class NoPreprocessing:
    """Routing never starts preprocessing: the engine connection does."""

    name = None

    def process(self, request):
        raise AssertionError("routing started preprocessing")


class TimedCall:
    """A call that streams one output after a delay, so requests overlap like real ones."""

    def __init__(self, delay_s: float, fail: BaseException | None) -> None:
        self.delay_s, self.fail = delay_s, fail

    async def __aiter__(self):
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        yield EngineEvent(outputs=[EngineCoreOutput("r", [5], finish_reason=FinishReason.LENGTH)])

    def cancel(self) -> None:
        pass


class Engine:
    """An engine connection: a state, an optional scheduler queue, a delay per request."""

    def __init__(self, index: int, on_generate=None) -> None:
        # The router names engines of a `StaticEngines` source by position.
        self.index, self.name, self.state, self.waiting, self.kv_usage = index, str(index), "ready", None, None
        self.fail: BaseException | None = None
        self.delay_s = 0.0
        self.on_generate = on_generate
        self.requests: list[EngineCoreRequest] = []

    async def info(self) -> EngineInfo:
        return EngineInfo(state=self.state, builtin=True, handshake_address="tcp://x:1", max_model_len=100_000,
                          engine_waiting=self.waiting, engine_kv_cache_usage=self.kv_usage)

    def close(self) -> None:
        pass

    def generate(self, request, images):
        self.requests.append(request)
        if self.on_generate is not None:
            self.on_generate(self.name)
        return TimedCall(self.delay_s, self.fail)


def _router(engines, **routing) -> EngineRouter:
    return EngineRouter([StaticEngines(engines)], wait_timeout_s=0.0, refresh_interval_s=0.0, routing=routing_settings(**routing))


async def _send(router: EngineRouter, tokens: list[int], images: PendingImages | None = None, request_id: str = "r") -> None:
    async for _ in router.generate(_request(tokens, request_id), images):
        pass


def _prefix(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(blocks * PREFIX_BLOCK_TOKENS)]


def _stream_of_repeats(replicas: list[tuple[EngineRouter, list[Engine]]], rng: random.Random, prefixes: list[list[int]]) -> tuple[int, int]:
    """600 overlapping requests for 40 images and 20 shared prefixes, repeated at random, each taken by
    one of the `replicas` (a router and its engine connections; drawn at random when there are several).
    Answers (repeats, repeats that reached the engine their content went to first)."""
    first_engine: dict[str, str] = {}
    outcomes = {"repeats": 0, "to_first": 0}

    async def one(n: int, content: str, tokens: list[int], images: PendingImages | None) -> None:
        router, engines = replicas[rng.randrange(len(replicas))] if len(replicas) > 1 else replicas[0]
        await _send(router, tokens, images, request_id=str(n))
        served = next(e.name for e in engines if any(r.request_id == str(n) for r in e.requests))
        if content in first_engine:
            outcomes["repeats"] += 1
            outcomes["to_first"] += served == first_engine[content]
        else:
            first_engine[content] = served

    async def stream() -> None:
        tasks = []
        for n in range(600):
            for _, engines in replicas:
                for engine in engines:
                    engine.delay_s = rng.uniform(0.005, 0.04)
            if rng.random() < 0.5:
                k = rng.randrange(40)
                content, tokens, images = f"image{k}", [7] * 40, _images(f"data:image/png;base64,IMAGE{k}")
            else:
                k = rng.randrange(20)
                content, images = f"prefix{k}", None
                tokens = prefixes[k] + [rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 300))]
            tasks.append(asyncio.create_task(one(n, content, tokens, images)))
            await asyncio.sleep(rng.uniform(0, 0.0015))
            if content not in first_engine:
                await tasks[-1]  # the first request with some content is routed first
        await asyncio.gather(*tasks)

    asyncio.run(stream())
    return outcomes["repeats"], outcomes["to_first"]


@pytest.mark.parametrize("bound", [4, routing_settings().max_imbalance])
def test_repeated_images_and_prefixes_stay_on_their_first_engine_within_the_load_bound(bound):
    """Issue 11's routing criterion: a stream of overlapping requests (≈8 in flight), 40 images
    and 20 shared prompt prefixes repeated at random; ≥ 90 % of repeats go where the content went
    first, and no choice puts an engine more than `max_imbalance` above the least loaded.
    (Measured: 98 % at a bound of 4, 99 % at 8; the bound decides below that: 91 % at 2, 84 % at 1.)"""
    violations: list[tuple[int, int]] = []
    in_flight: list[int] = []
    engines: list[Engine] = []

    def check_bound(chosen: str) -> None:
        loads = [router.load(e.name) - (e.name == chosen) for e in engines]  # as they were at the choice
        in_flight.append(sum(loads))
        if loads[int(chosen)] > min(loads) + bound:
            violations.append((loads[int(chosen)], min(loads)))

    engines += [Engine(0, check_bound), Engine(1, check_bound)]
    router = _router(engines, max_imbalance=bound)
    repeats, to_first = _stream_of_repeats([(router, engines)], random.Random(7), [_prefix(1000 + j, 2) for j in range(20)])
    share = to_first / repeats
    print(f"repeats to their first engine: {to_first}/{repeats} = {share:.1%}; "
          f"requests per engine: {[len(e.requests) for e in engines]}; mean in flight {sum(in_flight) / len(in_flight):.1f}")
    assert repeats >= 500
    assert share >= 0.90
    assert violations == []
    assert all(len(e.requests) >= 150 for e in engines)  # both engines serve: the content spreads


def test_an_affine_engine_past_the_bound_loses_the_request_to_the_least_loaded():
    keys = affinity_keys([], [image_key("data:a")])
    table = AffinityTable(16)
    table.record(keys, "b")
    affine = table.affine_engines(keys)
    idle = {"a": 0, "b": 0}
    assert choose_engine(["a", "b"], {"a": 0, "b": 2}, idle, affine, max_imbalance=2) == "b"
    assert choose_engine(["a", "b"], {"a": 0, "b": 3}, idle, affine, max_imbalance=2) == "a"
    assert choose_engine(["a"], idle, idle, affine, max_imbalance=2) == "a"  # the affine engine is not ready


def test_the_engines_queue_counts_as_load():
    engines = [Engine(0), Engine(1)]
    router = _router(engines, max_imbalance=1)
    asyncio.run(_send(router, [1], _images("data:a")))
    first = engines[0] if engines[0].requests else engines[1]
    other = engines[1 - first.index]
    first.waiting = 1  # its scheduler stats: one request queued, within the bound
    asyncio.run(_send(router, [1], _images("data:a")))
    assert (len(first.requests), len(other.requests)) == (2, 0)
    first.waiting = 2  # two queued: past the bound
    asyncio.run(_send(router, [1], _images("data:a")))
    assert (len(first.requests), len(other.requests)) == (2, 1)


def test_an_engine_with_a_full_kv_cache_counts_as_past_the_bound():
    """KV-cache usage at `routing.kv_cache_full` or above: the engine holding the content (or the one its
    hash names) loses it to the other, as if its load were past the bound; below, it keeps it. With both
    full, the load decides again."""
    engines = [Engine(0), Engine(1)]
    router = _router(engines, max_imbalance=1, kv_cache_full=0.9)
    asyncio.run(_send(router, [1], _images("data:a")))
    first = engines[0] if engines[0].requests else engines[1]
    other = engines[1 - first.index]
    first.kv_usage, other.kv_usage = 0.89, 0.1
    asyncio.run(_send(router, [1], _images("data:a")))
    assert (len(first.requests), len(other.requests)) == (2, 0)
    first.kv_usage = 0.9
    asyncio.run(_send(router, [1], _images("data:a")))
    assert (len(first.requests), len(other.requests)) == (2, 1)
    assert router.load(first.name) == 0 + 1 + 1  # nothing in flight, max_imbalance + 1
    # New content whose hash names the full engine goes to the other too.
    fresh = next(f"data:b{k}" for k in range(100) if home_engine(affinity_keys([], [image_key(f"data:b{k}")]), ["0", "1"]) == first.name)
    asyncio.run(_send(router, [1], _images(fresh)))
    assert (len(first.requests), len(other.requests)) == (2, 2)
    first.kv_usage = other.kv_usage = 0.95  # both full: the same penalty, the load (and affinity) decide
    asyncio.run(_send(router, [1], _images("data:a")))
    assert len(first.requests) + len(other.requests) == 5


def test_the_longest_shared_prefix_wins():
    shared = _prefix(1, 3)
    engines = [Engine(0), Engine(1)]
    router = _router(engines)
    table = router.affinity
    table.record(affinity_keys(shared[: 2 * PREFIX_BLOCK_TOKENS]), "0")
    table.record(affinity_keys(shared), "1")  # the first two blocks stay engine 0's: 1 holds block 3 alone
    table.record(affinity_keys(shared[: PREFIX_BLOCK_TOKENS]), "0")
    asyncio.run(_send(router, shared + [9, 9]))
    assert (len(engines[0].requests), len(engines[1].requests)) == (0, 1)
    # A prompt that differs in its first block shares nothing, however long the rest.
    other = [shared[0] + 1, *shared[1:]]
    assert table.affine_engines(affinity_keys(other)) == {}


def _holder(router: EngineRouter, image: bytes) -> str | None:
    """The engine the router's affinity table holds `image` for (None: no engine)."""
    holders = router.affinity.affine_engines(AffinityKeys(images=(image,), prefix_blocks=()))
    assert len(holders) <= 1
    return next(iter(holders), None)


def test_an_engine_that_dies_is_dropped_from_affinity():
    engines = [Engine(0), Engine(1)]
    router = _router(engines)
    for k in range(8):
        asyncio.run(_send(router, [1], _images(f"data:{k}")))
    holders = {_holder(router, key) for k in range(8) for key in affinity_keys([], [image_key(f"data:{k}")]).images}
    assert holders == {"0", "1"}
    engines[0].state = "dead"
    asyncio.run(router.refresh())
    assert {_holder(router, key) for k in range(8) for key in affinity_keys([], [image_key(f"data:{k}")]).images} == {None, "1"}
    # Restarted: its caches are empty, so its old images are not routed back to it.
    engines[0].state = "ready"
    asyncio.run(router.refresh())
    assert all(_holder(router, key) != "0" for k in range(8) for key in affinity_keys([], [image_key(f"data:{k}")]).images)


def test_an_engine_failing_a_request_is_dropped_from_affinity_and_the_request_goes_elsewhere():
    engines = [Engine(0), Engine(1)]
    router = _router(engines)
    asyncio.run(_send(router, [1], _images("data:x")))
    holder = engines[0] if engines[0].requests else engines[1]
    holder.fail = EngineDeadError("gone")
    asyncio.run(_send(router, [1], _images("data:x", "data:y")))
    survivor = engines[1 - holder.index]
    assert len(survivor.requests) == 1
    keys = affinity_keys([], [image_key("data:x"), image_key("data:y")])
    assert [_holder(router, k) for k in keys.images] == [survivor.name, survivor.name]


def test_a_full_affinity_table_evicts_the_least_recently_used():
    table = AffinityTable(3)
    a, b, c, d = (affinity_keys([], [image_key(f"data:{n}")]) for n in "abcd")
    table.record(a, 0)
    table.record(b, 1)
    table.record(c, 0)
    assert table.affine_engines(a) == {0: (1, 0)}
    table.record(a, 0)  # served again: now the most recent
    table.record(d, 1)
    assert len(table) == 3
    assert b.images[0] not in table and all(k.images[0] in table for k in (a, c, d))
    blocks = affinity_keys(_prefix(3, 5))
    table.record(blocks, 1)  # five blocks in a table of three: only the last three stay
    assert len(table) == 3 and table.affine_engines(blocks) == {1: (0, 5)}
    with pytest.raises(ValueError):
        AffinityTable(0)


def test_affinity_off_is_least_loaded_only():
    engines = [Engine(0), Engine(1)]
    router = _router(engines, affinity=False)
    for _ in range(4):
        asyncio.run(_send(router, [1], _images("data:same")))
    assert (len(engines[0].requests), len(engines[1].requests)) == (2, 2)
    assert len(router.affinity) == 0


def test_long_image_references_are_keyed_by_a_sample_that_still_tells_images_apart():
    from mmserve.transit.affinity import IMAGE_KEY_FULL_CHARS, image_key
    from tests.support.images import image_uri

    a, b = image_uri(640, 480, seed=1), image_uri(640, 480, seed=2)
    assert len(a) > IMAGE_KEY_FULL_CHARS and len(b) > IMAGE_KEY_FULL_CHARS
    same = "".join([a[: len(a) // 2], a[len(a) // 2 :]])  # equal content, another string object
    assert same is not a and image_key(same) == image_key(a) != image_key(b)
    assert image_key(a + "A") != image_key(a)  # the length counts
    assert image_key("data:short") != image_key("data:shorT")


def test_two_ingress_replicas_send_repeats_to_the_same_engine():
    """Issue 20: two ingress replicas (two routers, each with its own table and its own view of the load)
    over the same two engines, a stream of overlapping requests for 40 images and 20 shared prefixes,
    each request taken by either replica at random: ≥ 90 % of repeats reach the engine the content went
    to first, whichever replica sent it there, and no choice breaks a router's load bound."""
    bound = routing_settings().max_imbalance
    violations: list[tuple[int, int]] = []

    def replica() -> tuple[EngineRouter, list[Engine]]:
        engines: list[Engine] = []

        def check_bound(chosen: str) -> None:
            loads = [router.load(e.name) - (e.name == chosen) for e in engines]
            if loads[int(chosen)] > min(loads) + bound:
                violations.append((loads[int(chosen)], min(loads)))

        engines += [Engine(0, check_bound), Engine(1, check_bound)]
        router = _router(engines)
        return router, engines

    replicas = [replica(), replica()]
    repeats, to_first = _stream_of_repeats(replicas, random.Random(11), [_prefix(2000 + j, 2) for j in range(20)])
    share = to_first / repeats
    per_engine = [sum(len(engines[i].requests) for _, engines in replicas) for i in (0, 1)]
    print(f"two replicas: repeats to their first engine {to_first}/{repeats} = {share:.1%}; per engine {per_engine}")
    assert repeats >= 500
    assert share >= 0.90
    assert violations == []
    assert min(per_engine) >= 150
