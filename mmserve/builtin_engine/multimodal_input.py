"""The built-in engine's checks of received multimodal items, and the proof line each one adds to the answer."""

from __future__ import annotations

import collections
import hashlib
import re
from typing import Any

from .fake_model import ModelInfo
from .wire_engine_side import ReceivedFeature, ReceivedTensor


class MultimodalError(ValueError):
    """A multimodal item is inconsistent with itself or with the prompt (the request fails)."""


def _flat_tensor(value: Any, key: str) -> ReceivedTensor:
    if not isinstance(value, ReceivedTensor):
        raise MultimodalError(f"{key}: expected one tensor, got {type(value).__name__}")
    return value


def describe_feature(model: ModelInfo, feature: ReceivedFeature, index: int) -> str:
    """The proof line of one multimodal item; raises MultimodalError if it is inconsistent."""
    assert feature.data is not None
    data = {k: v.data for k, v in feature.data.items()}
    modality = feature.modality
    pixel_key, grid_key = {
        "image": ("pixel_values", "image_grid_thw"),
        "video": ("pixel_values_videos", "video_grid_thw"),
    }.get(modality, (None, None))
    embed_count = feature.length
    if feature.is_embed is not None:
        embed_count = sum(1 for b in feature.is_embed.data if b)
    if pixel_key in data and grid_key in data:
        pixels = _flat_tensor(data[pixel_key], pixel_key)
        grid = _flat_tensor(data[grid_key], grid_key)
        thw = grid.as_ints()
        if len(thw) != 3 or any(v <= 0 for v in thw):
            raise MultimodalError(f"{grid_key} must hold 3 positive ints, got {thw}")
        t, h, w = thw
        patches = pixels.shape[0] if pixels.shape else 0
        if patches != t * h * w:
            raise MultimodalError(f"{pixel_key} has {patches} patches, grid {t}x{h}x{w} needs {t * h * w}")
        tokens = t * h * w // (model.merge_size**2)
        if tokens != embed_count:
            raise MultimodalError(
                f"grid {t}x{h}x{w} makes {tokens} placeholder tokens, mm_position says {embed_count}"
            )
        digest = hashlib.sha256(pixels.data).hexdigest()[:16]
        return f"[{modality} {index}: grid {t}x{h}x{w}, {patches} patches {pixels.dtype}, sha256 {digest}]"
    # Any other item: list its tensors and hash them in key order.
    sha = hashlib.sha256()
    parts = []
    for key in sorted(data):
        value = data[key]
        if isinstance(value, ReceivedTensor):
            sha.update(value.data)
            parts.append(f"{key} {value.dtype}{list(value.shape)}")
        else:
            parts.append(f"{key} {type(value).__name__}")
    return f"[{modality} {index}: {', '.join(parts) or 'no data'}, sha256 {sha.hexdigest()[:16]}]"


def check_positions(model: ModelInfo, prompt: list[int], feature: ReceivedFeature) -> None:
    off, length = feature.offset, feature.length
    if off < 0 or length <= 0 or off + length > len(prompt):
        raise MultimodalError(
            f"{feature.modality} placeholder [{off}, {off + length}) outside the prompt of {len(prompt)} tokens"
        )
    pad = {"image": model.image_token_id, "video": model.video_token_id}.get(feature.modality)
    if pad is None:
        return
    mask = None
    if feature.is_embed is not None:
        if feature.is_embed.shape != (length,):
            raise MultimodalError(f"is_embed shape {feature.is_embed.shape} != ({length},)")
        mask = feature.is_embed.data
    for i in range(length):
        if (mask is None or mask[i]) and prompt[off + i] != pad:
            raise MultimodalError(
                f"prompt token {off + i} is {prompt[off + i]}, expected the {feature.modality} token {pad}"
            )


class ProofLines:
    """The proof lines of a request's items, and of recently seen items by hash: with vLLM's
    sender cache the front-end sends an item it sent before as its hash alone (no data)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_hash: collections.OrderedDict[str, str] = collections.OrderedDict()

    def clear(self) -> None:
        self._by_hash.clear()

    def for_request(self, model: ModelInfo, prompt: list[int], features: list[ReceivedFeature]) -> tuple[list[str], list[str]]:
        """(proof lines, hashes of items sent without data that are not cached); raises MultimodalError."""
        lines: list[str] = []
        missing: list[str] = []
        counts: dict[str, int] = {}
        for feature in features:
            counts[feature.modality] = index = counts.get(feature.modality, 0) + 1
            cache_key = feature.mm_hash or feature.identifier
            check_positions(model, prompt, feature)
            if feature.data is None:
                line = self._by_hash.get(cache_key)
                if line is None:
                    missing.append(cache_key)
                    continue
                self._by_hash.move_to_end(cache_key)
                line = re.sub(r"^\[\S+ \d+:", f"[{feature.modality} {index}:", line)
            else:
                line = describe_feature(model, feature, index)
                self._by_hash[cache_key] = line
                if len(self._by_hash) > self.capacity:
                    self._by_hash.popitem(last=False)
            lines.append(line)
        return lines, missing
