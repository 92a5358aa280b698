"""Placeholder expansion: processed images into the engine request's prompt and `mm_features`.

The ingress tokenizes the prompt with ONE placeholder token per image (so tokenization never
waits for pixels); the engine-client tier expands each here to the image's token count, with
`mm_position` at its first token. The engine client's `admit` then checks the result against
the prompt before anything is sent (vLLM treats a mismatch as fatal).
"""

from __future__ import annotations

import msgspec

from ..wire import BatchedField, EngineCoreRequest, FieldElem, FlatField, MultiModalFeatureSpec, PlaceholderRange, WireTensor
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
                # No fields: the engine holds the image, sent by hash only (`ProcessedImage`).
                data={field.name: _field_elem(field) for field in image.fields} if image.fields else None,
                modality="image",
                identifier=image.mm_hash,
                mm_position=PlaceholderRange(offset=offset, length=image.num_tokens),
                mm_hash=image.mm_hash,
            )
        )
    expanded.extend(prompt_token_ids[start:])
    return expanded, features


def attach_images(request: EngineCoreRequest, images: ProcessedImages) -> EngineCoreRequest:
    """`request` with its image placeholders expanded and its `mm_features` set."""
    prompt, features = expand_image_placeholders(request.prompt_token_ids or [], images)
    return msgspec.structs.replace(request, prompt_token_ids=prompt, mm_features=features)
