"""The preprocessing tier's work for one request: fetch → header checks → decode → family pixels.

CPU-heavy (decode, resize, patchify), so it runs in its own autoscaled deployment; fetches run
concurrently, pixel work runs in a worker thread (numpy and Pillow release the GIL) so the
replica keeps accepting requests. Every limit is checked before the step it protects: the
image count before any fetch, the byte size while fetching, the pixel count from the header
before decoding.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..vision import ImageError, ImageLimits, PixelDtype, decode_image, read_header
from ..fetch import FetchError, FetchPolicy, fetch_image_bytes
from .errors import ImageInputError
from .families import ImageFamily, pixel_dtype_for
from .types import ImageBatchRequest, PixelMode, ProcessedImage, ProcessedImages


@dataclass(frozen=True)
class PreprocessorLimits:
    max_images_per_request: int = 8
    image: ImageLimits = ImageLimits()


class ProcessedImageCache:
    """Recently processed images by (encoded bytes, pixel dtype), bounded by pixel bytes.

    Repeated images (a system image, a multi-turn chat resending its history) skip decode,
    resize and hashing. Keyed by a digest of the encoded bytes, never by URL: what a URL
    serves may change.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # Pixel work runs in worker threads, several requests at a time.
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[bytes, PixelDtype], ProcessedImage] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(data: bytes, dtype: PixelDtype) -> tuple[bytes, PixelDtype]:
        return hashlib.sha256(data).digest(), dtype

    def get(self, key: tuple[bytes, PixelDtype]) -> ProcessedImage | None:
        with self._lock:
            image = self._entries.get(key)
            if image is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return image

    def put(self, key: tuple[bytes, PixelDtype], image: ProcessedImage) -> None:
        size = sum(field.array.nbytes for field in image.fields)
        with self._lock:
            if size > self.max_bytes or key in self._entries:
                return
            self._entries[key] = image
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= sum(field.array.nbytes for field in evicted.fields)


class ImagePreprocessor:
    def __init__(
        self, family: ImageFamily, fetch_policy: FetchPolicy, limits: PreprocessorLimits, cache_bytes: int = 0
    ) -> None:
        self.family = family
        self.fetch_policy = fetch_policy
        self.limits = limits
        self.cache = ProcessedImageCache(cache_bytes) if cache_bytes > 0 else None

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
            key = self.cache.key(data, dtype) if self.cache is not None else None
            cached = self.cache.get(key) if key is not None else None
            if cached is not None:
                out.append(cached)
                continue
            try:
                read_header(data, self.limits.image)  # pixel count from the header, before decoding
                image = decode_image(data, self.limits.image)
                processed = self.family.process(image, dtype)
            except ImageError as exc:
                raise ImageInputError(str(exc), index=index) from None
            except ValueError as exc:  # e.g. an aspect ratio the family cannot resize
                raise ImageInputError(f"cannot process this image: {exc}", index=index) from None
            if key is not None:
                self.cache.put(key, processed)
            out.append(processed)
        return out
