"""What travels between the ingress, the preprocessor and the engine client for images.

`ImageBatchRequest` is small (URLs, settings). `ProcessedImages` carries the tensors: the
preprocessor returns it, Ray puts it in the object store once, and the engine client reads
its numpy arrays zero-copy from there (Ray pickles numpy arrays as out-of-band buffers).
The ingress only ever holds the not-yet-resolved response, never the arrays — unless the answer
is under Ray's 100-KiB inline limit (a small image), which Ray returns inline to the ingress.
"""

from __future__ import annotations

import enum
from typing import Literal

import msgspec
import numpy as np


class PixelMode(str, enum.Enum):
    """How the engine expects pixels (sending the wrong kind raises no error, only wrong answers).

    DEVICE_NORMALIZE: uint8 resized patches, the engine normalises on its device (vLLM 0.32's
    default for Qwen2-VL). HOST_NORMALIZE: normalised floats cast to the engine's dtype
    (engines started with `--no-mm-device-do-normalize`; always the case for LLaVA).
    """

    DEVICE_NORMALIZE = "device_normalize"
    HOST_NORMALIZE = "host_normalize"


class ImageBatchRequest(msgspec.Struct, frozen=True):
    """The images of one request, in prompt order, and how to process them."""

    urls: list[str]
    pixel_mode: PixelMode
    # The engine's dtype from its handshake ("bfloat16", "float16", "float32").
    engine_dtype: str


class ImageField(msgspec.Struct, frozen=True):
    """One keyword argument of one image for the engine (a `MultiModalFieldElem` to be)."""

    name: str
    array: np.ndarray
    # torch dtype name on the wire ("uint8", "int64", "bfloat16" carried as uint16 bits, ...).
    dtype: str
    # "flat": rows 0..N of the item's tensor (Qwen2-VL pixel_values); "batched": one tensor.
    layout: Literal["flat", "batched"]
    keep_on_cpu: bool = False


class ProcessedImage(msgspec.Struct, frozen=True):
    # Empty for an image recalled without its pixels (`recent_images.py`), which the engine holds.
    fields: list[ImageField]
    # Placeholder tokens the image takes in the prompt.
    num_tokens: int
    # Full-length content hash: the engine's `identifier` and `mm_hash`.
    mm_hash: str
    width: int
    height: int


class ProcessedImages(msgspec.Struct, frozen=True):
    """The preprocessor's answer for one request."""

    images: list[ProcessedImage]
    # The prompt token each image's single placeholder token expands into (e.g. <|image_pad|>).
    placeholder_token_id: int
    family: str
    preprocess_ms: float = 0.0
