"""The preprocessing tier's work for one request: fetch → header checks → pixel budget → decode → family pixels.

CPU-heavy (decode, resize, patchify), so it runs in its own autoscaled deployment; fetches run
concurrently, pixel work runs in a worker thread (numpy and Pillow release the GIL) so the
replica keeps accepting requests. Every limit is checked before the step it protects: the
image count before any fetch, the byte size while fetching, the pixel count from every header
before any decoding, and then the replica's pixel budget (`pixel_budget.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..vision import ImageError, ImageHeader, ImageLimits, PixelDtype, decode_image, read_header
from ..fetch import FetchError, FetchPolicy, fetch_image_bytes
from .errors import ImageInputError, ImagesTooLargeError, PreprocessorBusyError
from .families import ImageFamily, pixel_dtype_for
from .pixel_budget import BUSY_RETRY_AFTER_S, PixelBudget
from .types import ImageBatchRequest, PixelMode, ProcessedImage, ProcessedImages


@dataclass(frozen=True)
class PreprocessorLimits:
    max_images_per_request: int
    image: ImageLimits
    # Pixels decoded at once per replica (`PixelBudget`).
    max_pixels_in_flight: int


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
        self, family: ImageFamily, fetch_policy: FetchPolicy, limits: PreprocessorLimits, cache_bytes: int
    ) -> None:
        self.family = family
        self.fetch_policy = fetch_policy
        self.limits = limits
        self.cache = ProcessedImageCache(cache_bytes) if cache_bytes > 0 else None
        self.budget = PixelBudget(limits.max_pixels_in_flight)

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

    def _process_all(self, payloads: list[bytes], dtype: PixelDtype) -> list[ProcessedImage]:
        """Cache lookups and every header first, then admission by pixels, then decoding."""
        keys = [self.cache.key(data, dtype) if self.cache is not None else None for data in payloads]
        found: dict[int, ProcessedImage] = {}
        headers: dict[int, ImageHeader] = {}  # the images to decode, by index
        first: dict[object, int] = {}  # a repeat within the request is decoded once, at its first index
        for index, (data, key) in enumerate(zip(payloads, keys)):
            if key is not None:
                if key in first:
                    continue
                first[key] = index
                cached = self.cache.get(key)  # type: ignore[union-attr]
                if cached is not None:
                    found[index] = cached  # held from here: an eviction cannot make it a decode
                    continue
            try:
                headers[index] = read_header(data, self.limits.image)
            except ImageError as exc:
                raise ImageInputError(str(exc), index=index) from None
        demand = self._admit(headers)
        try:
            for index in headers:
                found[index] = self._process_one(payloads[index], dtype, index)
                if keys[index] is not None:
                    self.cache.put(keys[index], found[index])  # type: ignore[union-attr]
        finally:
            self.budget.release(demand)
        # A repeat within the request is its first occurrence's image.
        return [found[index] if index in found else found[first[keys[index]]] for index in range(len(payloads))]

    def _admit(self, headers: dict[int, ImageHeader]) -> int:
        """Take the request's pixels from the budget, or refuse it (413 never fits, 503 not now).

        Images are decoded one after another, so the demand is the largest one's pixels.
        """
        pixels = {index: header.width * header.height for index, header in headers.items()}
        largest = max(pixels, key=pixels.__getitem__, default=None)
        demand = 0 if largest is None else pixels[largest]
        if not self.budget.fits_alone(demand):
            header = headers[largest]  # type: ignore[index]
            raise ImagesTooLargeError(
                f"{header.width}x{header.height} = {demand} pixels, more than this server decodes at once "
                f"({self.budget.limit} pixels per preprocessor replica, images.max_pixels_in_flight)",
                index=largest,
            )
        if not self.budget.try_acquire(demand):
            raise PreprocessorBusyError(
                f"the image preprocessor is decoding other requests' images; {demand} more pixels do not fit "
                f"beside them (images.max_pixels_in_flight = {self.budget.limit}); retry shortly",
                retry_after_s=BUSY_RETRY_AFTER_S,
            )
        return demand

    def _process_one(self, data: bytes, dtype: PixelDtype, index: int) -> ProcessedImage:
        """One image's decode and pixels; its decoded image dies on return, before the next is decoded."""
        try:
            return self.family.process(decode_image(data, self.limits.image), dtype)
        except ImageError as exc:
            raise ImageInputError(str(exc), index=index) from None
        except ValueError as exc:  # e.g. an aspect ratio the family cannot resize
            raise ImageInputError(f"cannot process this image: {exc}", index=index) from None
