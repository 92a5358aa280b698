"""Cache affinity for engine routing: which engine recently served a request's images or its prompt prefix.

An engine that served an image holds its encoder output and its multimodal cache entry; one that
served a prompt prefix holds its KV blocks (vLLM's prefix caching). Sending a repeat there saves an
image encode or a prefill, so the router prefers that engine — but only while its load stays
within `routing.max_imbalance` of the least-loaded engine, so that affinity never piles
work on one engine.

What the router can key on: the request as the ingress hands it over, before preprocessing (whose
response is never awaited in the ingress, so the pixels' content hash is not known here). Images
are keyed by a digest of their reference as the client sent it — for a `data:` URI that is the
encoded bytes; an `http(s)` URL stands for its content. Prompts are keyed by a chain of hashes of
fixed blocks of token ids: block k's hash covers tokens 0..(k+1)·B, so one hit means the whole
prefix up to that block is shared, as in vLLM's own prefix cache. A wrong guess (a URL whose
content changed, a hash collision) only costs a cold cache, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# An engine as the router names it: the same name in every ingress replica (an engine-client
# deployment's index, or an engine-pool replica's id), which `home_engine` relies on.
EngineId = str

# Tokens per prefix block: vLLM CPU's KV block size (GPU engines use 16, which 128 is a multiple
# of, so a shared 128-token block is shared KV there too). Only full blocks are keyed, as vLLM
# caches only full blocks.
PREFIX_BLOCK_TOKENS = 128


@dataclass(frozen=True)
class AffinityKeys:
    """What a request could find cached on an engine: its images' keys and its prefix blocks' hashes, in prompt order."""

    images: tuple[bytes, ...]
    prefix_blocks: tuple[int, ...]


# Image references longer than this (in characters) are keyed by a sample (see `image_key`).
IMAGE_KEY_FULL_CHARS = 64 * 1024
_IMAGE_KEY_SLICES, _IMAGE_KEY_SLICE_CHARS = 64, 512


def image_key(url: str) -> bytes:
    """A routing key for an image reference. Hashing (or even encoding) data URIs of up to
    8 × 27 MB whole would stall the ingress's event loop for every request, so long ones are keyed
    by their length and 64 evenly spaced 512-character slices (the ends included): two different
    encoded images agreeing on all of those are not a realistic case, and would only cost a cold cache."""
    if len(url) <= IMAGE_KEY_FULL_CHARS:
        return hashlib.sha256(url.encode()).digest()[:16]
    digest = hashlib.sha256(len(url).to_bytes(8, "little"))
    step = (len(url) - _IMAGE_KEY_SLICE_CHARS) // (_IMAGE_KEY_SLICES - 1)
    for k in range(_IMAGE_KEY_SLICES):
        digest.update(url[k * step : k * step + _IMAGE_KEY_SLICE_CHARS].encode())
    return digest.digest()[:16]


def affinity_keys(prompt_token_ids: Sequence[int], image_keys: Sequence[bytes] = ()) -> AffinityKeys:
    """The request's keys: its images' (`image_key` of each URL) and its prompt's prefix blocks."""
    images = tuple(image_keys)
    blocks: list[int] = []
    chained = 0
    for end in range(PREFIX_BLOCK_TOKENS, len(prompt_token_ids) + 1, PREFIX_BLOCK_TOKENS):
        # Python's hash of a tuple of ints is not randomised per process: every ingress replica
        # (the same Python everywhere in a cluster) gets the same hashes, which `home_engine` relies on.
        chained = hash((chained, tuple(prompt_token_ids[end - PREFIX_BLOCK_TOKENS : end])))
        blocks.append(chained)
    return AffinityKeys(images, tuple(blocks))


class AffinityTable:
    """Key → the engine that first served it since it was last forgotten; a bounded LRU."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("affinity_entries must be at least 1")
        self.max_entries = max_entries
        self._engine_of: OrderedDict[bytes | int, EngineId] = OrderedDict()

    def __len__(self) -> int:
        return len(self._engine_of)

    def __contains__(self, key: bytes | int) -> bool:
        return key in self._engine_of

    def record(self, keys: AffinityKeys, engine: EngineId) -> None:
        """`engine` was given the request. Keys another engine holds stay with it (only touched):
        a repeat sent elsewhere because its engine was past the bound goes back there once the
        load allows, instead of its content drifting between engines with the load."""
        for key in (*keys.images, *keys.prefix_blocks):
            self._engine_of.setdefault(key, engine)
            self._engine_of.move_to_end(key)
        while len(self._engine_of) > self.max_entries:
            self._engine_of.popitem(last=False)

    def forget_engine(self, engine: EngineId) -> None:
        """An engine that died or restarted lost its caches: nothing should be routed to it for them."""
        for key in [k for k, e in self._engine_of.items() if e == engine]:
            del self._engine_of[key]

    def affine_engines(self, keys: AffinityKeys) -> dict[EngineId, tuple[int, int]]:
        """Per engine holding any of the keys: (images it holds, prefix blocks it holds), its score."""
        images: dict[EngineId, int] = {}
        for key in keys.images:
            engine = self._engine_of.get(key)
            if engine is not None:
                images[engine] = images.get(engine, 0) + 1
        # Block k's hash stands for the whole prefix up to it: per engine, the deepest hit.
        depth: dict[EngineId, int] = {}
        for k, key in enumerate(keys.prefix_blocks):
            engine = self._engine_of.get(key)
            if engine is not None:
                depth[engine] = k + 1
        return {e: (images.get(e, 0), depth.get(e, 0)) for e in images.keys() | depth.keys()}


def home_engine(keys: AffinityKeys, ready: Sequence[EngineId]) -> EngineId | None:
    """The engine every ingress replica sends content to that it has not routed before: rendezvous
    hashing of the request's first image key (else its first prefix block) over the ready engines.

    Each ingress replica keeps its own table (no state is shared, no call is added), so without a
    common first choice two replicas would send the same new image to different engines half of the
    time, and each would then keep its repeats there. Hashing the content with each engine's id (the
    same in every replica) gives them all the same choice; when that engine is out, or one joins,
    only the keys of that engine move. None: the request has nothing to key on."""
    if keys.images:
        key = keys.images[0]
    elif keys.prefix_blocks:
        key = keys.prefix_blocks[0].to_bytes(8, "little", signed=True)
    else:
        return None
    return max(ready, key=lambda e: hashlib.blake2b(key + e.encode(), digest_size=8).digest())


def choose_engine(
    ready: Sequence[EngineId],
    loads: Mapping[EngineId, int],
    routed: Mapping[EngineId, int],
    affine: dict[EngineId, tuple[int, int]],
    max_imbalance: int,
    home: EngineId | None = None,
) -> EngineId:
    """Among the engines within the imbalance bound: the one with the best affinity; else the content's
    home engine (`home_engine`); else the least loaded.

    `loads[e]` is engine e's load; `routed[e]` how many requests it was given, which breaks ties
    in load so that new content spreads over idle engines instead of always taking the first.
    """
    least = min(loads[i] for i in ready)
    within = [i for i in ready if i in affine and loads[i] <= least + max_imbalance]
    if within:
        return max(within, key=lambda i: (affine[i], -loads[i]))
    if home is not None and loads[home] <= least + max_imbalance:
        return home
    return min(ready, key=lambda i: (loads[i], routed[i], i))
