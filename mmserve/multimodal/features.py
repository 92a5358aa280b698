"""Turning processed images into the engine request's `mm_features` (engine-client side).

The ingress tokenizes the prompt with ONE placeholder token per image (so tokenization never
waits for pixels); here each is expanded to the image's token count, `mm_position` is set at
its first token, and everything is checked against the prompt before anything is sent. A
mismatch here would otherwise reach the engine, where vLLM treats it as fatal.
"""

from __future__ import annotations

from ..wire import BatchedField, FieldElem, FlatField, MultiModalFeatureSpec, PlaceholderRange, WireTensor
from .types import ImageField, ProcessedImages


class PlaceholderMismatch(ValueError):
    """The prompt's image placeholders do not match the images sent with it."""


def _field_elem(field: ImageField) -> FieldElem:
    tensor = WireTensor(field.array, field.dtype)
    if field.layout == "flat":
        rows = int(field.array.shape[0])
        return FieldElem(tensor, FlatField([[(0, rows, None)]], keep_on_cpu=field.keep_on_cpu))
    return FieldElem(tensor, BatchedField(keep_on_cpu=field.keep_on_cpu))


def expand_image_placeholders(
    prompt_token_ids: list[int], images: ProcessedImages
) -> tuple[list[int], list[MultiModalFeatureSpec]]:
    """Expand each image's placeholder and build its feature spec, in prompt order."""
    pad = images.placeholder_token_id
    positions = [i for i, token in enumerate(prompt_token_ids) if token == pad]
    if len(positions) != len(images.images):
        raise PlaceholderMismatch(
            f"the prompt has {len(positions)} image placeholders but {len(images.images)} images were given"
        )
    expanded: list[int] = []
    features: list[MultiModalFeatureSpec] = []
    start = 0
    for position, image in zip(positions, images.images):
        if image.num_tokens < 1:
            raise PlaceholderMismatch("an image must take at least one token")
        expanded.extend(prompt_token_ids[start:position])
        offset = len(expanded)
        expanded.extend([pad] * image.num_tokens)
        start = position + 1
        features.append(
            MultiModalFeatureSpec(
                data={field.name: _field_elem(field) for field in image.fields},
                modality="image",
                identifier=image.mm_hash,
                mm_position=PlaceholderRange(offset=offset, length=image.num_tokens),
                mm_hash=image.mm_hash,
            )
        )
    expanded.extend(prompt_token_ids[start:])
    check_features(expanded, features, pad)
    return expanded, features


def check_features(prompt_token_ids: list[int], features: list[MultiModalFeatureSpec], pad: int) -> None:
    """The final guard: ranges in bounds, ordered, non-overlapping, covering only pad tokens,
    and every tensor's byte size equal to shape × itemsize."""
    end_of_previous = 0
    for feature in features:
        rng = feature.mm_position
        if rng.offset < end_of_previous or rng.length < 1 or rng.offset + rng.length > len(prompt_token_ids):
            raise PlaceholderMismatch(f"image placeholder range {rng.offset}+{rng.length} is out of bounds or overlaps")
        if any(t != pad for t in prompt_token_ids[rng.offset : rng.offset + rng.length]):
            raise PlaceholderMismatch("an image placeholder range covers non-placeholder tokens")
        end_of_previous = rng.offset + rng.length
        for name, elem in (feature.data or {}).items():
            tensor = elem.data
            if tensor is None:
                continue
            expected = tensor.array.itemsize
            for dim in tensor.shape:
                expected *= dim
            if tensor.array.nbytes != expected:
                raise PlaceholderMismatch(f"tensor {name} has {tensor.array.nbytes} bytes, expected {expected}")
    if sum(t == pad for t in prompt_token_ids) != sum(f.mm_position.length for f in features):
        raise PlaceholderMismatch("the prompt has image placeholder tokens outside the images' ranges")
