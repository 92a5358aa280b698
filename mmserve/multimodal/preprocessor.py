"""The preprocessing tier's work for one request: fetch → header checks → pixel budget → decode → family pixels.

CPU-heavy (decode, resize, patchify), so it runs in its own autoscaled deployment; fetches run
concurrently, and pixel work runs on the replica's own pixel threads (as many as the CPUs it
reserves, one by default), so the replica keeps accepting requests while the work itself never
runs on more threads than it has cores (more threads on the same cores only add switching). A
cached image needs no pixel thread at all. Every limit
is checked before the step it protects: the image count before any fetch, the byte size while
fetching, the pixel count from every header before any decoding, and then the replica's pixel
budget (`pixel_budget.py`), at once, before a request waits for a pixel thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..vision import ImageError, ImageHeader, ImageLimits, PixelDtype, decode_image, read_header
from ..fetch import FetchError, FetchPolicy, fetch_image_bytes
from .errors import ImageInputError, ImagesTooLargeError, PreprocessorBusyError
from .families import ImageFamily, pixel_dtype_for
from .pixel_budget import BUSY_RETRY_AFTER_S, PixelBudget
from .types import ImageBatchRequest, PixelMode, ProcessedImage, ProcessedImages


# A request's encoded images are hashed for the cache on the event loop up to this size (a short
# stall), beyond it on a worker thread, so that a request of large images never stalls the others.
HASH_ON_LOOP_MAX_BYTES = 1 << 20


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


@dataclass
class _PixelWork:
    """One request's images after admission: those found (cache, repeats) and those to decode."""

    payloads: list[bytes]
    keys: list[tuple[bytes, PixelDtype] | None]
    found: dict[int, ProcessedImage] = field(default_factory=dict)
    to_decode: dict[int, ImageHeader] = field(default_factory=dict)
    # A repeat within the request is decoded once, at its first index.
    first: dict[object, int] = field(default_factory=dict)
    demand: int = 0  # pixels taken from the budget, given back when the decoding ends

    def images(self) -> list[ProcessedImage]:
        """In request order; a repeat within the request is its first occurrence's image."""
        return [
            self.found[index] if index in self.found else self.found[self.first[self.keys[index]]]
            for index in range(len(self.payloads))
        ]


class ImagePreprocessor:
    def __init__(
        self, family: ImageFamily, fetch_policy: FetchPolicy, limits: PreprocessorLimits, cache_bytes: int,
        pixel_threads: int = 1,
    ) -> None:
        self.family = family
        self.fetch_policy = fetch_policy
        self.limits = limits
        self.cache = ProcessedImageCache(cache_bytes) if cache_bytes > 0 else None
        self.budget = PixelBudget(limits.max_pixels_in_flight)
        if pixel_threads < 1:
            raise ValueError(f"pixel_threads must be at least 1, got {pixel_threads}")
        self._pixel_threads = ThreadPoolExecutor(max_workers=pixel_threads, thread_name_prefix="mmserve-pixels")

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
        keys = (
            await asyncio.to_thread(self._cache_keys, payloads, dtype)
            if sum(map(len, payloads)) > HASH_ON_LOOP_MAX_BYTES
            else self._cache_keys(payloads, dtype)
        )
        # From admission to the decoding's submission nothing awaits: admitted pixels always reach
        # `_decode_admitted`, which gives them back.
        work = self._admit_all(payloads, keys)
        if work.to_decode:
            decoding = self._pixel_threads.submit(self._decode_admitted, work, dtype)
            # Shielded: the decoding runs (and gives its pixels back) even if this request is
            # cancelled while it waits for a pixel thread; its outcome is then nobody's.
            decoding.add_done_callback(_retrieved)
            await asyncio.shield(asyncio.wrap_future(decoding))
        images = work.images()
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

    def _cache_keys(self, payloads: list[bytes], dtype: PixelDtype) -> list[tuple[bytes, PixelDtype] | None]:
        return [self.cache.key(data, dtype) if self.cache is not None else None for data in payloads]

    def _admit_all(self, payloads: list[bytes], keys: list[tuple[bytes, PixelDtype] | None]) -> _PixelWork:
        """Cache lookups and every header first, then admission by pixels: all before any decoding,
        on the event loop (headers are cheap), so a request that does not fit is refused at once."""
        work = _PixelWork(payloads, keys)
        for index, (data, key) in enumerate(zip(payloads, work.keys)):
            if key is not None:
                if key in work.first:
                    continue
                work.first[key] = index
                cached = self.cache.get(key)  # type: ignore[union-attr]
                if cached is not None:
                    work.found[index] = cached  # held from here: an eviction cannot make it a decode
                    continue
            try:
                work.to_decode[index] = read_header(data, self.limits.image)
            except ImageError as exc:
                raise ImageInputError(str(exc), index=index) from None
        work.demand = self._admit(work.to_decode)
        return work

    def _decode_admitted(self, work: _PixelWork, dtype: PixelDtype) -> None:
        """On a pixel thread: decode what `_admit_all` admitted, then give its pixels back."""
        try:
            for index in work.to_decode:
                work.found[index] = self._process_one(work.payloads[index], dtype, index)
                if work.keys[index] is not None:
                    self.cache.put(work.keys[index], work.found[index])  # type: ignore[union-attr]
        finally:
            self.budget.release(work.demand)

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


def _retrieved(decoding: Future) -> None:
    """Mark a decoding's error as seen: a request cancelled while it waited no longer awaits it."""
    if not decoding.cancelled():
        decoding.exception()
