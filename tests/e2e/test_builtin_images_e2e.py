"""Image chats through the whole graph on the built-in engine, whose answer proves what it got."""

from __future__ import annotations

import base64
import hashlib
import io
import re
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from mmserve.multimodal import PixelMode, load_image_family, pixel_dtype_for
from mmserve.vision import decode_rgb
from tests.support.defaults import image_limits
from serve_app.config import BUILTIN_MODEL_DIR

pytestmark = pytest.mark.serve


def _image_bytes(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _expected_proof(data: bytes, index: int) -> str:
    family = load_image_family(BUILTIN_MODEL_DIR)
    image = family.process(decode_rgb(data, image_limits()), pixel_dtype_for(PixelMode.DEVICE_NORMALIZE, "bfloat16"))
    pixels = image.fields[0].array
    t, h, w = (int(v) for v in image.fields[1].array)
    digest = hashlib.sha256(pixels.tobytes()).hexdigest()[:16]
    return f"[image {index}: grid {t}x{h}x{w}, {pixels.shape[0]} patches uint8, sha256 {digest}]"


def test_two_images_reach_the_engine_intact(builtin_app):
    first, second = _image_bytes(300, 200, seed=1), _image_bytes(56, 84, seed=2, fmt="JPEG")
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": _data_uri(first)}},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": _data_uri(second, "image/jpeg"), "detail": "high"}},
    ]}]
    resp = builtin_app.openai().chat.completions.create(
        model="mmserve-builtin", messages=messages, max_tokens=200, temperature=0, extra_body={"return_token_ids": True})
    text = resp.choices[0].message.content
    assert _expected_proof(first, 1) in text
    assert _expected_proof(second, 2) in text
    family = load_image_family(BUILTIN_MODEL_DIR)
    prompt = resp.model_extra["prompt_token_ids"]
    expected_pads = family.num_tokens(300, 200) + family.num_tokens(56, 84)
    assert prompt.count(family.placeholder_token_id) == expected_pads
    assert resp.usage.prompt_tokens == len(prompt)


def test_streaming_image_chat(builtin_app):
    data = _image_bytes(640, 480, seed=3)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_uri(data)}},
                                             {"type": "text", "text": "What is this?"}]}]
    stream = builtin_app.openai().chat.completions.create(
        model="mmserve-builtin", messages=messages, max_tokens=200, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert _expected_proof(data, 1) in text


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("data:image/png;base64,not!base64!!", "base64"),
        (_data_uri(b"definitely not an image"), ""),
        (_data_uri(_image_bytes(64, 64, 0)[:80]), ""),
        ("http://127.0.0.1:9/x.png", "loopback"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("file:///etc/passwd", ""),
        ("ftp://example.com/a.png", "scheme"),
    ],
)
def test_bad_images_get_400(builtin_app, url, fragment):
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 8}
    for stream in (False, True):
        resp = httpx.post(builtin_app.base_url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "invalid_request_error"
        assert fragment.lower() in resp.json()["error"]["message"].lower()


def test_decompression_bomb_header_is_refused(builtin_app):
    # A PNG whose header claims 50 000 x 50 000 pixels; only the header is real.
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 50000, 50000, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b"")
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_uri(png)}}]}]}
    resp = httpx.post(builtin_app.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400
    assert re.search(r"pixel", resp.json()["error"]["message"], re.I)


def test_too_many_images(builtin_app):
    uri = _data_uri(_image_bytes(28, 28, 0))
    parts = [{"type": "image_url", "image_url": {"url": uri}} for _ in range(9)]
    resp = httpx.post(builtin_app.base_url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": parts}]}, timeout=60)
    assert resp.status_code == 413
    assert "at most 8" in resp.json()["error"]["message"] and "images.max_images_per_request" in resp.json()["error"]["message"]
    # The engine still serves.
    ok = builtin_app.openai().chat.completions.create(model="mmserve-builtin", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


def _metric(app, sample: str) -> float:
    """One sample's value in the ingress's `/metrics`."""
    text = httpx.get(app.base_url + "/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert found is not None, f"{sample} is not in /metrics"
    return float(found.group(1))


def _preprocessed_images(app) -> float:
    """Images the ingress observed a preprocessing time for."""
    return _metric(app, "mmserve_preprocess_seconds_per_image_count")


def test_a_repeated_image_goes_by_hash_without_the_preprocessor_and_comes_back_if_the_engine_lost_it(builtin_app):
    """A multi-turn chat resends its images: a data URI the engine client had processed, which the
    engine still holds, is recalled (`RecentImages`) and sent by hash only, no preprocessing; if the
    engine lost it meanwhile (drift, here forced), its pixels are processed anew and the request
    resent with them; an image never seen makes the whole request go to the preprocessor."""
    client = builtin_app.openai()
    client.chat.completions.create(model="mmserve-builtin", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    data, other = _image_bytes(200, 120, seed=41), _image_bytes(90, 60, seed=42)

    def ask(*images: bytes) -> str:
        parts = [{"type": "image_url", "image_url": {"url": _data_uri(image)}} for image in images]
        resp = client.chat.completions.create(
            model="mmserve-builtin", max_tokens=200, temperature=0,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}],
        )  # fmt: skip
        return resp.choices[0].message.content

    def counts() -> tuple[int, int, int, int]:
        info = builtin_app.engine_info()
        return info.image_requests_received, info.images_recalled, info.mm_items_skipped, info.mm_cache_miss_resends

    start = counts()
    assert _expected_proof(data, 1) in ask(data)
    first = counts()
    assert (first[0] - start[0], first[1:]) == (1, start[1:])  # processed, sent with its pixels

    before_bytes, preprocessed = builtin_app.engine_info().bytes_sent, _preprocessed_images(builtin_app)
    assert _expected_proof(data, 1) in ask(data)
    repeat = counts()
    assert [a - b for a, b in zip(repeat, first)] == [1, 1, 1, 0]  # recalled, sent by hash
    assert builtin_app.engine_info().bytes_sent - before_bytes < 4096
    assert _preprocessed_images(builtin_app) == preprocessed  # no preprocessing time observed for it
    recalled_metric = 'mmserve_engine_image_requests_recalled{engine="0"}'
    deadline = time.monotonic() + 10  # (the ingress refreshes what it knows of an engine every few seconds)
    while _metric(builtin_app, recalled_metric) != repeat[1] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(builtin_app, recalled_metric) == repeat[1]

    builtin_app.engine_utility("reset_mm_cache")  # the engine forgets it; the engine client does not know
    assert _expected_proof(data, 1) in ask(data)
    lost = counts()
    assert [a - b for a, b in zip(lost, repeat)] == [1, 1, 1, 1]  # recalled, missed, processed anew and resent

    text = ask(data, other)  # one image never seen: no recall, both processed
    assert _expected_proof(data, 1) in text and _expected_proof(other, 2) in text
    mixed = counts()
    assert mixed[1] == lost[1]
