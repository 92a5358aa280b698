"""Skip resending images an engine already holds: a mirror of the engine's multimodal receiver cache.

A vLLM engine started with its processor cache in `lru` mode (the default: `--mm-processor-cache-gb 4
--mm-processor-cache-type lru`) keeps the items it was sent in an LRU keyed by `mm_hash`, and serves
an item sent with `data: None` from there. vLLM's own front-end keeps a metadata-only replica of that
LRU (`LruKeyReplicatedSenderCache`, vllm/multimodal/cache/lru.py) and sends `None` for every item the
replica holds. The engine client is the single sender to its engine, so it can keep the same replica:
this module is it, following vLLM 0.32 step for step:

- capacity: `2**30 × mm_processor_cache_gb` bytes; an item's size is the sum of its tensors' nbytes
  (`MultiModalCache.get_item_size`), an item larger than the whole cache is never cached;
- per request: first every item's key is touched (moved to the most-recent end if held), then, in
  order, a held item is looked up (moved to the end, sent without data) and any other item is
  inserted (evicting least-recent items until it fits, sent with data) — the receiver does exactly
  this in the same order, so both sides evict the same keys;
- a key the engine reports missing (`mm_cache_miss_hashes`, drift) is dropped from the replica.

The replica must see requests in wire order: `EngineClient` updates it and sends under one lock.
Engines whose cache cannot be mirrored (cache off, `shm` type, a data-parallel group) get full data.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import msgspec

from ..wire import MultiModalFeatureSpec, ReadyResponse

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class EngineCacheSettings:
    """The engine's multimodal processor cache, as its `vllm serve` flags set it. The handshake does
    not carry these: they come from the engine's launch arguments (ours, or the operator's config)."""

    # --mm-processor-cache-gb (0 turns the cache off).
    processor_cache_gb: float
    # --mm-processor-cache-type.
    processor_cache_type: Literal["lru", "shm"]


def feature_key(feature: MultiModalFeatureSpec) -> str:
    """The receiver cache's key for an item (vLLM: `mm_hash or identifier`)."""
    return feature.mm_hash or feature.identifier


def carries_data_for(features: list[MultiModalFeatureSpec] | None, keys: list[str]) -> bool:
    """Whether `features` carry the data of every item in `keys` (else resending them cannot help)."""
    with_data = {feature_key(f) for f in features or [] if f.data is not None}
    return all(key in with_data for key in keys)


def item_size(feature: MultiModalFeatureSpec) -> int:
    """Bytes the engine charges the item against its cache: the sum of its tensors' nbytes."""
    if feature.data is None:
        raise ValueError(f"item {feature_key(feature)} has no data to size")
    return sum(elem.data.nbytes for elem in feature.data.values() if elem.data is not None)


class SenderCacheMirror:
    """Which items an engine holds, by key and size, in the engine's LRU order."""

    def __init__(self, capacity_bytes: float) -> None:
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self.used_bytes = 0

    @classmethod
    def for_engine(cls, settings: EngineCacheSettings, ready: ReadyResponse) -> SenderCacheMirror | None:
        """The mirror for an engine, or None (send full data always) when its cache is not an LRU
        this process alone feeds — the cases where vLLM's `_get_cache_type` gives no `lru`."""
        reason = None
        if settings.processor_cache_gb <= 0:
            reason = "its multimodal processor cache is off (mm_processor_cache_gb=0)"
        elif settings.processor_cache_type != "lru":
            reason = f"its multimodal processor cache type is {settings.processor_cache_type!r}, not 'lru'"
        elif ready.data_parallel_size > 1:
            reason = f"it is one of a data-parallel group of {ready.data_parallel_size} (no engine-side item cache)"
        if reason is not None:
            logger.warning("images are sent in full to this engine on every request: %s", reason)
            return None
        logger.info("images the engine holds are sent by hash only (mirroring its %.3g GiB LRU)", settings.processor_cache_gb)
        return cls(GIB * settings.processor_cache_gb)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[str]:
        """Held keys, least recently used first."""
        return list(self._sizes)

    def prepare(self, features: list[MultiModalFeatureSpec], *, force_data: bool = False) -> list[MultiModalFeatureSpec]:
        """Update the mirror for one request about to be sent, and return its items as they must be
        sent: without data where the engine holds them. `force_data` sends every item's data (a
        resend after a miss); the engine then replaces each item, which the mirror follows too."""
        keys = [feature_key(f) for f in features]
        for key in keys:
            if key in self._sizes:
                self._sizes.move_to_end(key)
        prepared: list[MultiModalFeatureSpec] = []
        for feature, key in zip(features, keys):
            if key in self._sizes:
                self._sizes.move_to_end(key)
                if not force_data:
                    prepared.append(msgspec.structs.replace(feature, data=None))
                    continue
            elif feature.data is not None:
                self._insert_if_fits(key, item_size(feature))
            # An item the caller itself sent by hash only, and the mirror does not hold, goes as it
            # is: the engine answers a miss for it if it does not hold it either.
            prepared.append(feature)
        return prepared

    def invalidate(self, key: str) -> None:
        """Forget a key (the engine reported it missing, or a send failed)."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    def clear(self) -> None:
        self._sizes.clear()
        self.used_bytes = 0

    def _insert_if_fits(self, key: str, size: int) -> None:
        # cachetools.LRUCache.__setitem__: too large for the whole cache → not cached; else evict
        # least-recent items until it fits, then append it as the most recent.
        if size > self.capacity_bytes:
            return
        while self.used_bytes + size > self.capacity_bytes:
            _, evicted = self._sizes.popitem(last=False)
            self.used_bytes -= evicted
        self._sizes[key] = size
        self.used_bytes += size
