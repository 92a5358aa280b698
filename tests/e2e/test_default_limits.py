"""The limits as a user meets them: README's quick start with its default configuration, under a
real `serve run`. The largest request the default caps allow is served on an idle replica; past
a cap, a 413 naming the limit; a body that does not fit the busy replica's budget now, a 503 with
`Retry-After`, and the same request served once the bodies holding the budget are gone."""

from __future__ import annotations

import base64
import io
import socket
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from serve_app.config import AppConfig

from .serve_run_support import ServeRun

pytestmark = pytest.mark.serve

MiB = 1024 * 1024
CHAT = "/v1/chat/completions"
DEFAULTS = AppConfig()


@pytest.fixture(scope="module")
def default_run():
    with ServeRun({}) as run:  # no arguments: the built-in engine and every default
        yield run


def _png_near(size_bytes: int, seed: int) -> bytes:
    """A valid PNG of just under `size_bytes` (noise, stored uncompressed)."""
    side = int(((size_bytes - 4096) / 3) ** 0.5)
    while (side * 3 + 1) * side + 4096 > size_bytes:
        side -= 1
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=0)
    data = buf.getvalue()
    assert size_bytes - 64 * 1024 < len(data) <= size_bytes, len(data)
    return data


def _image_chat(images: list[bytes], max_tokens: int = 4) -> bytes:
    parts = b",".join(
        b'{"type": "image_url", "image_url": {"url": "data:image/png;base64,' + base64.b64encode(data) + b'"}}'
        for data in images
    )
    return (b'{"model": "mmserve-builtin", "max_tokens": %d, "messages": [{"role": "user", "content": ['
            b'{"type": "text", "text": "describe"}, ' % max_tokens + parts + b"]}]}")


def _post(run: ServeRun, body: bytes) -> httpx.Response:
    return httpx.post(run.base_url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=300)


def _budget_held(run: ServeRun) -> float:
    text = httpx.get(run.base_url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mmserve_ingress_body_budget_held_bytes"))


def test_the_largest_request_the_default_caps_allow_is_served_on_an_idle_replica(default_run):
    images = DEFAULTS.images
    largest = [_png_near(images.max_image_bytes, seed) for seed in range(images.max_images_per_request)]
    body = _image_chat(largest)
    assert len(body) > 8 * 26 * MiB  # 8 images of (nearly) 20 MiB, base64-encoded
    resp = _post(default_run, body)
    assert resp.status_code == 200, resp.text[:500]
    assert resp.json()["usage"]["prompt_tokens"] > 8  # the images' tokens reached the engine
    deadline = time.monotonic() + 10
    while _budget_held(default_run) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _budget_held(default_run) == 0


def test_past_a_cap_is_a_413_naming_the_limit(default_run):
    small = _png_near(64 * 1024, 0)
    resp = _post(default_run, _image_chat([small] * (DEFAULTS.images.max_images_per_request + 1)))
    assert resp.status_code == 413, resp.text[:300]
    assert "images.max_images_per_request" in resp.json()["error"]["message"]
    oversize = small + b"\0" * (21 * MiB)  # 21 MiB: the bytes after IEND make it no larger an image
    resp = _post(default_run, _image_chat([oversize]))
    assert resp.status_code == 413, resp.text[:300]
    error = resp.json()["error"]
    assert "images.max_image_bytes" in error["message"] and error["param"] == "messages"


def _hold_budget(run: ServeRun, sent_bytes: int) -> socket.socket:
    """A client that declares a large image body, sends `sent_bytes` of it, and waits."""
    prefix = b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,'
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {sent_bytes + 1024}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", run.port))
    sock.sendall(head + prefix + b"A" * (sent_bytes - len(prefix)))
    return sock


def test_a_busy_budget_answers_503_with_retry_after_and_the_same_request_is_served_later(default_run):
    held = _hold_budget(default_run, 200 * MiB)  # admitted (parsing 201 MiB fits the idle budget)
    try:
        deadline = time.monotonic() + 60
        while _budget_held(default_run) < 200 * MiB and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _budget_held(default_run) >= 200 * MiB
        # ≈133 MiB: fits an idle replica, not beside the 200 MiB held.
        body = _image_chat([_png_near(20 * MiB, seed) for seed in range(10, 15)])
        busy = _post(default_run, body)
        assert busy.status_code == 503, busy.text[:300]
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == "server_busy"
    finally:
        held.close()
    deadline = time.monotonic() + 30
    while _budget_held(default_run) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    served = _post(default_run, body)
    assert served.status_code == 200, served.text[:300]
