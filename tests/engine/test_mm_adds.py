"""ADDs whose items go by hash only on the caller's word (`EngineAdds` with a `Refill`): sent as they
are while the mirror holds the items, refilled first when it does not, refilled and resent when the
engine reports them missing, and not resent once the request is no longer in flight."""

from __future__ import annotations

import asyncio

import numpy as np

from mmserve.engine.mm_adds import EngineAdds
from mmserve.engine.mm_cache import SenderCacheMirror
from mmserve.wire import (
    BatchedField, EngineCoreRequest, FieldElem, FlatField, MultiModalFeatureSpec, PlaceholderRange, SamplingParams,
    WireTensor,
)


def _feature(key: str, *, data: bool) -> MultiModalFeatureSpec:
    pixels = np.full((4, 1176), 7, dtype=np.uint8)
    items = {
        "pixel_values": FieldElem(WireTensor(pixels), FlatField([[(0, 4, None)]])),
        "image_grid_thw": FieldElem(WireTensor(np.array([1, 2, 2], dtype=np.int64)), BatchedField(keep_on_cpu=True)),
    }
    return MultiModalFeatureSpec(
        data=items if data else None, modality="image", identifier=key,
        mm_position=PlaceholderRange(offset=0, length=1), mm_hash=key,
    )  # fmt: skip


def _request(*features: MultiModalFeatureSpec, request_id: str = "r1") -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, [9] * len(features), list(features), SamplingParams(max_tokens=4), None, 0.0, None, None, None
    )


PIXEL_BYTES = 4 * 1176


class _Engine:
    """What was sent: per ADD, its size in bytes (pixels or none)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def send(self, frames: list) -> None:
        self.sizes.append(sum(memoryview(frame).nbytes for frame in frames))

    def with_pixels(self) -> list[bool]:
        return [size >= PIXEL_BYTES for size in self.sizes]


def _adds(engine: _Engine, in_flight: set[str] | None = None) -> EngineAdds:
    adds = EngineAdds(engine.send, in_flight=(in_flight if in_flight is not None else {"r1"}).__contains__)
    adds.mirror = SenderCacheMirror(1 << 30)
    return adds


class _Refill:
    def __init__(self, request: EngineCoreRequest) -> None:
        self.request = request
        self.calls = 0

    async def __call__(self) -> EngineCoreRequest:
        self.calls += 1
        await asyncio.sleep(0)
        return self.request


async def test_items_held_go_by_hash_and_items_not_held_are_refilled_first():
    engine = _Engine()
    adds = _adds(engine)
    full = _request(_feature("a", data=True))
    await adds.send(full)  # the mirror now holds "a"
    by_hash = _request(_feature("a", data=False))
    refill = _Refill(full)
    assert await adds.send(by_hash, refill=refill) is by_hash
    assert refill.calls == 0
    adds.mirror.invalidate("a")  # evicted since the caller chose to send it by hash
    assert await adds.send(by_hash, refill=refill) is full
    assert refill.calls == 1
    assert engine.with_pixels() == [True, False, True]
    assert "a" in adds.mirror


async def test_without_a_mirror_a_request_by_hash_is_refilled():
    engine = _Engine()
    adds = _adds(engine)
    adds.mirror = None  # the engine's cache cannot be mirrored: it holds nothing on our word
    full = _request(_feature("a", data=True))
    refill = _Refill(full)
    await adds.send(_request(_feature("a", data=False)), refill=refill)
    assert refill.calls == 1 and engine.with_pixels() == [True]


async def test_a_miss_of_an_item_sent_by_hash_is_refilled_and_resent_unless_aborted_meanwhile():
    engine = _Engine()
    in_flight = {"r1"}
    adds = _adds(engine, in_flight)
    full = _request(_feature("a", data=True))
    await adds.send(full)
    by_hash = _request(_feature("a", data=False))
    await adds.send(by_hash, refill=_Refill(full))
    failures: list[str] = []
    fail = lambda request_id, error: failures.append(f"{request_id}: {error}")  # noqa: E731
    # Without a refill there is no data to resend.
    assert not adds.resend_on_cache_miss(by_hash, ["a"], fail)
    refill = _Refill(full)
    assert adds.resend_on_cache_miss(by_hash, ["a"], fail, refill)
    await asyncio.gather(*adds._resends)
    assert refill.calls == 1 and engine.with_pixels() == [True, False, True]
    in_flight.clear()  # aborted while its items were refilled: not resent
    assert adds.resend_on_cache_miss(by_hash, ["a"], fail, _Refill(full))
    await asyncio.gather(*adds._resends)
    assert engine.with_pixels() == [True, False, True] and failures == []
