"""The preprocessing tier's work for one request: fetch → header checks → decode → family pixels.

CPU-heavy (decode, resize, patchify), so it runs in its own autoscaled deployment; fetches run
concurrently, pixel work runs in a worker thread (numpy and Pillow release the GIL) so the
replica keeps accepting requests. Every limit is checked before the step it protects: the
image count before any fetch, the byte size while fetching, the pixel count from the header
before decoding.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ..vision import ImageError, ImageLimits, decode_image, read_header
from ..vision.fetch import FetchError, FetchPolicy, fetch_image_bytes
from .errors import ImageInputError
from .families import ImageFamily, pixel_dtype_for
from .types import ImageBatchRequest, PixelMode, ProcessedImage, ProcessedImages


@dataclass(frozen=True)
class PreprocessorLimits:
    max_images_per_request: int = 8
    image: ImageLimits = ImageLimits()


class ImagePreprocessor:
    def __init__(self, family: ImageFamily, fetch_policy: FetchPolicy, limits: PreprocessorLimits) -> None:
        self.family = family
        self.fetch_policy = fetch_policy
        self.limits = limits

    async def process(self, request: ImageBatchRequest) -> ProcessedImages:
        started = time.perf_counter()
        if len(request.urls) > self.limits.max_images_per_request:
            raise ImageInputError(
                f"{len(request.urls)} images in one request; at most {self.limits.max_images_per_request} are allowed"
            )
        if request.pixel_mode is PixelMode.DEVICE_NORMALIZE and not self.family.supports_device_normalize:
            raise ImageInputError(f"{self.family.name} engines need host-normalised pixels (pixel_mode=host_normalize)")
        dtype = pixel_dtype_for(request.pixel_mode, request.engine_dtype)
        payloads = await asyncio.gather(*(self._fetch(i, url) for i, url in enumerate(request.urls)))
        images = await asyncio.to_thread(self._process_all, payloads, dtype)
        return ProcessedImages(
            images=images,
            placeholder_token_id=self.family.placeholder_token_id,
            family=self.family.name,
            preprocess_ms=(time.perf_counter() - started) * 1e3,
        )

    async def _fetch(self, index: int, url: str) -> bytes:
        try:
            return await fetch_image_bytes(url, self.fetch_policy)
        except (FetchError, ImageError) as exc:
            raise ImageInputError(str(exc), index=index) from None

    def _process_all(self, payloads: list[bytes], dtype) -> list[ProcessedImage]:
        out = []
        for index, data in enumerate(payloads):
            try:
                read_header(data, self.limits.image)  # pixel count from the header, before decoding
                image = decode_image(data, self.limits.image)
                out.append(self.family.process(image, dtype))
            except ImageError as exc:
                raise ImageInputError(str(exc), index=index) from None
            except ValueError as exc:  # e.g. an aspect ratio the family cannot resize
                raise ImageInputError(f"cannot process this image: {exc}", index=index) from None
        return out
