"""Content hashes for processed images: the engine's `mm_hash` / `identifier`.

The engine keys its encoder cache, its multimodal receiver cache and prefix-cache blocks on this
string, so equal strings must mean equal pixels as the engine receives them. The hash therefore covers
the processed pixels plus everything that turns them into the tensor on the wire: the model family,
the processor settings and the output dtype. It is a full SHA-256 digest (64 hex characters), never
truncated: a collision would silently answer about the wrong image.

What is hashed are the resized uint8 pixels (after resizing and cropping), not the final patches: the
patch layout, the temporal duplication, the normalisation and the dtype cast are deterministic
functions of those pixels and of the settings, which are hashed too, so the key identifies the same
content while hashing 2x (uint8 Qwen patches) to 8x (float32 patches) fewer bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["content_hash"]

_VERSION = b"mmserve.vision/1"  # bump if the meaning of the hashed fields ever changes


def content_hash(
    *, family: str, settings: str, output_dtype: str, pixels: np.ndarray | Sequence[np.ndarray]
) -> str:
    """SHA-256 hex over (family, settings, output dtype, pixel shape and dtype, pixel bytes).

    `settings` is a canonical text form of the processor settings (the settings dataclass's repr);
    every text field is length-prefixed so that no two different field tuples hash the same bytes.
    `pixels` is one array, or a sequence of equally shaped planes hashed exactly as their `np.stack`
    (channel planes need not be copied into one array first).

    SHA-256 stays: on CPUs with the SHA extensions OpenSSL's SHA-256 is faster than `hashlib.blake2b`.
    """
    planes = [pixels] if isinstance(pixels, np.ndarray) else list(pixels)
    if not planes:
        raise ValueError("no pixels to hash")
    first = planes[0]
    if any(plane.shape != first.shape or plane.dtype != first.dtype for plane in planes):
        raise ValueError("planes to hash must share one shape and dtype")
    shape = first.shape if isinstance(pixels, np.ndarray) else (len(planes), *first.shape)
    digest = hashlib.sha256()
    digest.update(_VERSION)
    for field in (family, settings, output_dtype, first.dtype.str, repr(tuple(shape))):
        encoded = field.encode()
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    for plane in planes:
        digest.update(memoryview(np.ascontiguousarray(plane)).cast("B"))
    return digest.hexdigest()
