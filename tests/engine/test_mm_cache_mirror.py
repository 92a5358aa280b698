"""The sender mirror against vLLM 0.32's own multimodal caches (vllm imported here, in tests only).

Random request streams (repeats, duplicates within a request, items of many sizes, items larger
than the whole cache, capacity pressure) go through vLLM's `LruKeyReplicatedSenderCache` the way
vLLM's front-end drives it (`_merge_mm_kwargs`: touch all, then get_and_update in order) and through
`SenderCacheMirror.prepare`: the items sent without data must be the same, the held keys the same
in the same LRU order, and vLLM's `LruKeyReplicatedReceiverCache`, fed what the mirror sends, must
never miss.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from mmserve.engine.mm_cache import GIB, SenderCacheMirror, item_size  # noqa: E402
from tests.support.defaults import engine_cache_settings  # noqa: E402
from mmserve.wire import FieldElem, FlatField, BatchedField, MultiModalFeatureSpec, PlaceholderRange, ReadyResponse, WireTensor  # noqa: E402

# The reference implementation: installed by scripts/setup.sh; a missing vllm is a failure, not a skip.
import torch  # noqa: E402
from vllm.multimodal.cache.base import MultiModalCacheMissError  # noqa: E402
from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache, LruKeyReplicatedSenderCache  # noqa: E402
from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalFlatField, MultiModalKwargsItem  # noqa: E402


def _model_config(cache_gb: float):
    mm_config = SimpleNamespace(mm_processor_cache_gb=cache_gb)
    return SimpleNamespace(get_multimodal_config=lambda: mm_config)


def _ours(key: str, pixel_rows: int) -> MultiModalFeatureSpec:
    pixels = np.zeros((pixel_rows, 1176), dtype=np.uint8)
    grid = np.array([[1, 2, pixel_rows // 2]], dtype=np.int64)
    return MultiModalFeatureSpec(
        data={
            "pixel_values": FieldElem(WireTensor(pixels), FlatField([[(0, pixel_rows, None)]])),
            "image_grid_thw": FieldElem(WireTensor(grid), BatchedField(keep_on_cpu=True)),
        },
        modality="image", identifier=key, mm_position=PlaceholderRange(offset=0, length=1), mm_hash=key,
    )


def _vllms(pixel_rows: int) -> MultiModalKwargsItem:
    return MultiModalKwargsItem({
        "pixel_values": MultiModalFieldElem(torch.zeros((pixel_rows, 1176), dtype=torch.uint8), MultiModalFlatField(slices=[[slice(0, pixel_rows)]])),
        "image_grid_thw": MultiModalFieldElem(torch.tensor([[1, 2, pixel_rows // 2]]), MultiModalBatchedField(keep_on_cpu=True)),
    })


class VllmFailsRequest(Exception):
    """vLLM's front-end fails this request (see `_vllm_front_end_sends`)."""


def _vllm_front_end_sends(sender: LruKeyReplicatedSenderCache, request: list[tuple[str, int]]) -> list[bool]:
    """What vLLM's front-end sends for one request (True = with data), as `_get_cache_missing_items`
    and `_merge_mm_kwargs` drive its sender cache. A request whose new items evict one of its own
    items found cached a moment before fails in vLLM (an AssertionError in the cache):
    `VllmFailsRequest`, with the sender brought to the state the mirror reaches by sending that
    item in full (the one place where the mirror differs from vLLM, by design)."""
    keys = [key for key, _ in request]
    is_cached = sender.is_cached(keys)
    for key in keys:
        sender.touch_sender_cache_item(key)
    sent = []
    failed = False
    for (key, rows), cached in zip(request, is_cached):
        item = None if cached else (_vllms(rows), [])
        try:
            data, _ = sender.get_and_update_item(item, key)
        except AssertionError:
            failed = True
            data, _ = sender.get_and_update_item((_vllms(rows), []), key)
        sent.append(data is not None)
    if failed:
        raise VllmFailsRequest(sent)
    return sent


def _random_requests(rng: random.Random, n: int, sizes: dict[str, int]) -> list[list[tuple[str, int]]]:
    keys = list(sizes)
    requests = []
    for _ in range(n):
        count = rng.choice([1, 1, 1, 2, 3])
        chosen = [rng.choice(keys[: rng.randint(3, len(keys))]) for _ in range(count)]
        requests.append([(key, sizes[key]) for key in chosen])
    return requests


@pytest.mark.parametrize("seed", range(6))
def test_mirror_matches_vllm_sender_and_receiver_never_misses(seed):
    rng = random.Random(seed)
    # 1176 bytes per row + 24 bytes of grid per item; a 0.0001 GiB cache (≈107 KB) holds a few items,
    # so eviction happens constantly. Item 'huge' is larger than the whole cache.
    cache_gb = 0.0001
    sizes = {f"img{i}": rng.choice([2, 8, 16, 24, 40]) for i in range(12)}
    sizes["huge"] = 120
    requests = _random_requests(rng, 300, sizes)

    sender = LruKeyReplicatedSenderCache(_model_config(cache_gb))
    receiver = LruKeyReplicatedReceiverCache(_model_config(cache_gb))
    mirror = SenderCacheMirror(GIB * cache_gb)
    skipped = 0
    for request in requests:
        try:
            vllm_sent = _vllm_front_end_sends(sender, request)
        except VllmFailsRequest as failure:
            vllm_sent = failure.args[0]  # the mirror sends the evicted item in full instead
        ours = mirror.prepare([_ours(key, rows) for key, rows in request])
        assert [f.data is not None for f in ours] == vllm_sent
        assert mirror.keys() == list(sender._cache.order)
        assert mirror.used_bytes == sender._cache.currsize
        # The engine's side of the same request: it must hold everything sent by hash.
        features = [
            SimpleNamespace(mm_hash=f.mm_hash, identifier=f.identifier, data=None if f.data is None else _vllms(rows))
            for f, (_, rows) in zip(ours, request)
        ]
        receiver.get_and_update_features(features)
        assert list(receiver._cache.order) == mirror.keys()
        skipped += sum(f.data is None for f in ours)
    assert skipped > 50  # the streams really exercise hits, not only misses


def test_a_request_evicting_its_own_cached_item_fails_in_vllm_and_the_mirror_sends_that_item_in_full():
    cache_gb = 0.0001  # ≈107 KB: x and y (47 KB each) fit together, z (94 KB) evicts both
    sender = LruKeyReplicatedSenderCache(_model_config(cache_gb))
    mirror = SenderCacheMirror(GIB * cache_gb)
    primed = [("x", 40), ("y", 40)]
    assert _vllm_front_end_sends(sender, primed) == [True, True]
    mirror.prepare([_ours(key, rows) for key, rows in primed])
    request = [("z", 80), ("x", 40)]  # x is cached when the request starts; z's insertion evicts it
    with pytest.raises(VllmFailsRequest):
        _vllm_front_end_sends(sender, request)
    ours = mirror.prepare([_ours(key, rows) for key, rows in request])
    assert [f.data is not None for f in ours] == [True, True]  # x was evicted: sent with its data
    assert mirror.keys() == list(sender._cache.order)


def test_item_size_is_the_sum_of_tensor_nbytes_as_vllm_counts_it():
    from vllm.multimodal.cache.base import MultiModalCache

    assert item_size(_ours("a", 10)) == MultiModalCache.get_item_size(_vllms(10)) == 10 * 1176 + 3 * 8


def test_drift_recovery_and_resend_keep_the_mirror_equal_to_the_receiver():
    cache_gb = 0.0001
    receiver = LruKeyReplicatedReceiverCache(_model_config(cache_gb))
    mirror = SenderCacheMirror(GIB * cache_gb)

    def engine_receives(features, rows):
        specs = [SimpleNamespace(mm_hash=f.mm_hash, identifier=f.identifier, data=None if f.data is None else _vllms(rows)) for f in features]
        receiver.get_and_update_features(specs)

    first = mirror.prepare([_ours("a", 8), _ours("b", 8)])
    engine_receives(first, 8)
    receiver.clear_cache()  # the engine lost its items (vLLM's reset_mm_cache does this)
    again = mirror.prepare([_ours("a", 8), _ours("b", 8)])
    assert [f.data for f in again] == [None, None]
    with pytest.raises(MultiModalCacheMissError) as miss:
        engine_receives(again, 8)
    assert sorted(miss.value.mm_hashes) == ["a", "b"]
    for key in miss.value.mm_hashes:
        mirror.invalidate(key)
    resent = mirror.prepare([_ours("a", 8), _ours("b", 8)], force_data=True)
    assert all(f.data is not None for f in resent)
    engine_receives(resent, 8)
    assert list(receiver._cache.order) == mirror.keys() == ["a", "b"]
    # A forced resend of held items moves them like the receiver's replace does.
    resent = mirror.prepare([_ours("a", 8)], force_data=True)
    engine_receives(resent, 8)
    assert list(receiver._cache.order) == mirror.keys() == ["b", "a"]


def _ready(**kw) -> ReadyResponse:
    return ReadyResponse(max_model_len=1024, num_gpu_blocks=1, block_size=128, dtype="bfloat16", vllm_version="0.32.0", **kw)


def test_engines_whose_cache_cannot_be_mirrored_get_full_data(caplog):
    assert SenderCacheMirror.for_engine(engine_cache_settings(), _ready()).capacity_bytes == 4 * GIB
    assert SenderCacheMirror.for_engine(engine_cache_settings(processor_cache_gb=0.5), _ready()).capacity_bytes == GIB // 2
    with caplog.at_level("WARNING"):
        assert SenderCacheMirror.for_engine(engine_cache_settings(processor_cache_gb=0), _ready()) is None
        assert SenderCacheMirror.for_engine(engine_cache_settings(processor_cache_type="shm"), _ready()) is None
        assert SenderCacheMirror.for_engine(engine_cache_settings(), _ready(data_parallel_size=2)) is None
    assert caplog.text.count("sent in full") == 3
