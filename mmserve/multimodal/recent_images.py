"""What a preprocessor answered for recent data-URI images, their pixels left out.

An engine holds the images it was sent in its multimodal cache and takes them again by hash only
(`mmserve/engine/mm_cache.py`). A multi-turn chat resends every earlier image with each turn: with
this record the engine client sends such a request at once, by hash, instead of having the
preprocessor decode (or find in its cache), hash and write the same pixels to Ray's object store
again only for the engine client to leave them out of the request.

Only data URIs are remembered: their text is their content, whereas what a URL serves may change.
An entry is keyed by the URL's digest and everything else that decides the answer (the
preprocessor, its settings' version, the pixel mode and dtype asked for); it holds what the prompt
needs (the image's token count) and the engine's key for it (`mm_hash`). A recalled image carries
no fields: it can only go by hash, and whoever sends it must be able to process it anew if the
engine no longer holds it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable

import msgspec

from .types import ImageBatchRequest, ProcessedImage, ProcessedImages

# A few hundred bytes each: the digest, the hash, counts.
DEFAULT_MAX_ENTRIES = 4096

ImageKey = tuple[Hashable, str, str, bytes]


class _Recalled(msgspec.Struct, frozen=True):
    image: ProcessedImage  # without fields
    placeholder_token_id: int
    family: str


class RecentImages:
    """An LRU of recently processed data-URI images, without their pixels (one per engine client)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[ImageKey, _Recalled] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def keys(source: Hashable, request: ImageBatchRequest) -> list[ImageKey] | None:
        """The request's keys (`source`: the preprocessor and its settings' version), or None if an
        image is not a data URI (nothing of such a request is remembered)."""
        if not all(url.startswith("data:") for url in request.urls):
            return None
        mode = request.pixel_mode.value
        return [(source, mode, request.engine_dtype, hashlib.sha256(url.encode()).digest()) for url in request.urls]

    def recall(self, keys: list[ImageKey]) -> ProcessedImages | None:
        """The request's images, without pixels, if every one is remembered (all of one family)."""
        found: list[_Recalled] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                return None
            found.append(entry)
        if not found:
            return None
        first = found[0]
        if any(e.placeholder_token_id != first.placeholder_token_id or e.family != first.family for e in found):
            return None
        for key in keys:
            self._entries.move_to_end(key)
        return ProcessedImages(
            images=[entry.image for entry in found], placeholder_token_id=first.placeholder_token_id, family=first.family
        )

    def remember(self, keys: list[ImageKey], images: ProcessedImages) -> None:
        """Remember a preprocessor's answer for the request whose keys these are."""
        if len(keys) != len(images.images):
            raise ValueError(f"{len(keys)} keys for {len(images.images)} images")
        for key, image in zip(keys, images.images):
            self._entries[key] = _Recalled(
                msgspec.structs.replace(image, fields=[]), images.placeholder_token_id, images.family
            )
            self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
