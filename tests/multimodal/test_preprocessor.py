"""The preprocessor: limits before work, typed errors, the pixel budget, and the processed-image cache."""

from __future__ import annotations

import asyncio
import base64
import io
import math
import threading

import numpy as np
import pytest
from PIL import Image

from mmserve.multimodal import ImageBatchRequest, PixelMode, load_image_family
from mmserve.multimodal import preprocessor as preprocessor_module
from mmserve.multimodal.errors import ImageInputError, ImagesTooLargeError, PreprocessorBusyError
from mmserve.transit.refusals import refusal_of
from mmserve.multimodal.preprocessor import ImagePreprocessor
from serve_app.config import BUILTIN_MODEL_DIR, AppConfig
from serve_app.settings import preprocessor_settings
from tests.support.defaults import fetch_policy, preprocessor_limits


def _uri(width: int, height: int, seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _preprocessor(
    cache_bytes: int = 64 * 1024 * 1024, max_images: int = 4, max_pixels_in_flight: int = 10**8, pixel_threads: int = 1
) -> ImagePreprocessor:
    family = load_image_family(BUILTIN_MODEL_DIR)
    limits = preprocessor_limits(max_images_per_request=max_images, max_pixels_in_flight=max_pixels_in_flight)
    return ImagePreprocessor(family, fetch_policy(), limits, cache_bytes, pixel_threads=pixel_threads)


def _request(urls: list[str], mode: PixelMode = PixelMode.DEVICE_NORMALIZE) -> ImageBatchRequest:
    return ImageBatchRequest(urls=urls, pixel_mode=mode, engine_dtype="bfloat16")


def _run(pre: ImagePreprocessor, urls: list[str], mode: PixelMode = PixelMode.DEVICE_NORMALIZE):
    return asyncio.run(pre.process(_request(urls, mode)))


class Decodes:
    """The preprocessor's `decode_image`, counted; the first call after `hold()` waits for `let_go()`."""

    def __init__(self, decode, fake_image=None) -> None:
        self.decode, self.fake_image = decode, fake_image
        self.count = 0
        self.entered = threading.Event()  # the held call has started
        self._gate = threading.Event()
        self._held = False

    def hold(self) -> None:
        self._held = True

    def let_go(self) -> None:
        self._gate.set()

    def __call__(self, data, limits):
        self.count += 1
        held, self._held = self._held, False
        if held:
            self.entered.set()
            assert self._gate.wait(10)
        return self.fake_image if self.fake_image is not None else self.decode(data, limits)


@pytest.fixture
def decodes(monkeypatch) -> Decodes:
    counter = Decodes(preprocessor_module.decode_image)
    monkeypatch.setattr(preprocessor_module, "decode_image", counter)
    return counter


def test_repeated_images_come_from_the_cache_unchanged():
    pre = _preprocessor()
    a, b = _uri(300, 200, 1), _uri(100, 80, 2)
    first = _run(pre, [a, b])
    second = _run(pre, [b, a])
    assert pre.cache.hits == 2 and pre.cache.misses == 2
    assert second.images[0].mm_hash == first.images[1].mm_hash
    assert np.array_equal(second.images[1].fields[0].array, first.images[0].fields[0].array)
    # A different pixel mode is a different entry (different tensors on the wire).
    bf16 = _run(pre, [a], PixelMode.HOST_NORMALIZE)
    assert bf16.images[0].fields[0].dtype == "bfloat16" and pre.cache.misses == 3


def test_cache_is_bounded_by_pixel_bytes():
    pre = _preprocessor(cache_bytes=2_000_000)
    for seed in range(6):
        _run(pre, [_uri(448, 448, seed)])  # 1024 patches x 1176 bytes ≈ 1.2 MB each
    assert pre.cache._bytes <= 2_000_000
    assert len(pre.cache._entries) == 1


def test_too_many_images_refused_before_any_fetch():
    pre = _preprocessor(max_images=2)
    with pytest.raises(ImageInputError, match="at most 2"):
        _run(pre, ["http://never-fetched.invalid/a.png"] * 3)


def test_bad_image_names_its_position():
    pre = _preprocessor()
    with pytest.raises(ImageInputError, match="^image 2: "):
        _run(pre, [_uri(56, 56, 0), "data:image/png;base64," + base64.b64encode(b"not an image").decode()])


def test_a_request_over_the_budget_alone_is_a_413_and_nothing_is_decoded(decodes):
    pre = _preprocessor(max_pixels_in_flight=100_000)
    with pytest.raises(ImagesTooLargeError, match=r"^image 2: 400x300 = 120000 pixels.*images.max_pixels_in_flight") as refused:
        _run(pre, [_uri(100, 80, 0), _uri(400, 300, 1)])
    assert decodes.count == 0 and pre.budget.in_use == 0
    assert refusal_of(refused.value).kind == "image_too_large"


def test_requests_that_do_not_fit_together_get_a_503_at_once_and_fit_later(decodes):
    pre = _preprocessor(max_pixels_in_flight=100_000)
    first, second, small = _uri(300, 200, 0), _uri(200, 300, 1), _uri(100, 80, 2)
    _run(pre, [small])  # cached from here on

    async def scenario():
        decodes.hold()
        running = asyncio.create_task(pre.process(_request([first])))  # 60 000 pixels, held in decode
        assert await asyncio.to_thread(decodes.entered.wait, 10)
        with pytest.raises(PreprocessorBusyError) as busy:
            await pre.process(_request([second]))  # 60 000 more do not fit in 100 000
        decoded_while_busy = decodes.count
        cached = await pre.process(_request([small]))  # cached: no pixels to decode, admitted
        decodes.let_go()
        await running
        return busy.value, decoded_while_busy, cached, await pre.process(_request([second]))

    busy, decoded_while_busy, cached, later = asyncio.run(scenario())
    assert decoded_while_busy == 2  # `small` once, `first`: never `second` while busy
    assert busy.retry_after_s == 1
    refusal = refusal_of(busy)
    assert (refusal.kind, refusal.retry_after_s) == ("busy", 1)
    assert len(cached.images) == 1 and len(later.images) == 1
    assert pre.budget.in_use == 0 and pre.budget.refused == 1 and pre.budget.peak == 60_000


def test_the_default_settings_admit_the_largest_request_they_allow(monkeypatch):
    """8 images of images.max_image_pixels each, on an idle replica with every setting at its default."""
    settings = preprocessor_settings(AppConfig())
    limits = settings.limits
    side = math.isqrt(limits.image.max_pixels)
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, "PNG")  # a 1-bit image: a few kB whatever its size
    # Distinct payloads (bytes after IEND are ignored), so that no image is a repeat of another.
    images = [buf.getvalue() + bytes([i]) for i in range(limits.max_images_per_request)]
    # Decoding 8 × 50 MP for real would take seconds and gigabytes: the decode hands out a small image.
    decodes = Decodes(None, fake_image=Image.new("RGB", (56, 56)))
    monkeypatch.setattr(preprocessor_module, "decode_image", decodes)
    family = load_image_family(BUILTIN_MODEL_DIR)
    pre = ImagePreprocessor(family, settings.fetch, limits, settings.cache_bytes)
    out = _run(pre, ["data:image/png;base64," + base64.b64encode(data).decode() for data in images])
    assert len(out.images) == limits.max_images_per_request and decodes.count == limits.max_images_per_request
    assert pre.budget.peak == side * side and pre.budget.in_use == 0


def test_the_budget_is_given_back_after_success_and_after_a_failing_image(decodes):
    pre = _preprocessor(max_pixels_in_flight=100_000)
    _run(pre, [_uri(300, 200, 0), _uri(100, 80, 1)])
    assert pre.budget.peak == 60_000 and pre.budget.in_use == 0
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    truncated = "data:image/png;base64," + base64.b64encode(buf.getvalue()[: len(buf.getvalue()) // 2]).decode()
    with pytest.raises(ImageInputError, match="^image 2: cannot decode"):  # its header is fine: it fails decoding
        _run(pre, [_uri(120, 100, 3), truncated])
    assert pre.budget.in_use == 0 and decodes.count == 4


@pytest.mark.parametrize("pixel_threads", [1, 2])
def test_pixel_work_runs_on_the_replicas_pixel_threads_only(monkeypatch, pixel_threads):
    """However many requests wait, no more images are decoded at once than the replica has pixel
    threads (the cores it reserves): more threads on the same cores only cost CPU."""
    decode, lock, gate = preprocessor_module.decode_image, threading.Lock(), threading.Event()
    active = {"now": 0, "most": 0, "done": 0}

    def slow_decode(data, limits):
        with lock:
            active["now"] += 1
            active["most"] = max(active["most"], active["now"])
        gate.wait(10)  # every decode waits until all requests have been sent
        with lock:
            active["now"] -= 1
            active["done"] += 1
        return decode(data, limits)

    monkeypatch.setattr(preprocessor_module, "decode_image", slow_decode)
    pre = _preprocessor(pixel_threads=pixel_threads)

    async def scenario():
        requests = [asyncio.create_task(pre.process(_request([_uri(64, 48, seed)]))) for seed in range(6)]
        await asyncio.sleep(0.5)  # time for every thread there is to start decoding
        decoding_at_once = active["now"]
        gate.set()
        return decoding_at_once, await asyncio.gather(*requests)

    decoding_at_once, outputs = asyncio.run(scenario())
    assert decoding_at_once == active["most"] == pixel_threads
    assert all(len(out.images) == 1 for out in outputs) and active["done"] == 6


def test_a_request_cancelled_while_waiting_for_a_pixel_thread_gives_its_pixels_back(decodes):
    pre = _preprocessor(max_pixels_in_flight=100_000)

    async def scenario():
        decodes.hold()
        first = asyncio.create_task(pre.process(_request([_uri(100, 100, 0)])))
        assert await asyncio.to_thread(decodes.entered.wait, 10)
        waiting = asyncio.create_task(pre.process(_request([_uri(200, 100, 1)])))
        while pre.budget.in_use < 30_000:  # admitted, waiting for the one pixel thread
            await asyncio.sleep(0.01)
        waiting.cancel()
        decodes.let_go()
        await first
        for _ in range(500):
            if pre.budget.in_use == 0:
                break
            await asyncio.sleep(0.01)
        return waiting

    waiting = asyncio.run(scenario())
    assert waiting.cancelled()
    assert pre.budget.in_use == 0 and pre.budget.peak == 30_000 and decodes.count == 2



@pytest.mark.parametrize("over", [False, True])
def test_cache_keys_are_hashed_off_the_event_loop_only_for_requests_over_the_threshold(monkeypatch, over):
    """Hashing 1 MiB takes ≈0.5 ms: below `HASH_ON_LOOP_MAX_BYTES` a request's keys are hashed on the
    event loop (no thread hop), above it on a worker thread (the loop keeps serving other requests).
    Either way the keys are the same: the same image is a cache hit across the threshold."""
    uri = _uri(96, 64, 7)
    encoded = len(base64.b64decode(uri.split(",", 1)[1]))
    # The threshold just below or just above this request's encoded bytes.
    monkeypatch.setattr(preprocessor_module, "HASH_ON_LOOP_MAX_BYTES", encoded - 1 if over else encoded)
    pre = _preprocessor()
    keys_computed = pre._cache_keys
    hashed_on: list[bool] = []

    def recorded(payloads, dtype):
        hashed_on.append(threading.current_thread() is threading.main_thread())  # asyncio.run's loop thread
        return keys_computed(payloads, dtype)

    monkeypatch.setattr(pre, "_cache_keys", recorded)
    first = _run(pre, [uri])
    monkeypatch.setattr(preprocessor_module, "HASH_ON_LOOP_MAX_BYTES", encoded if over else encoded - 1)
    second = _run(pre, [uri])  # hashed the other way: still the same key, so from the cache
    assert hashed_on == ([False, True] if over else [True, False])
    assert pre.cache.hits == 1 and second.images[0] is first.images[0]
