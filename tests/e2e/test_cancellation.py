"""A client that goes away cancels its work: before its first token, mid-stream, while its
images are still being preprocessed, and while one is still being fetched. In each case the
engine holds no request of it within 1 s and the engine client's in-flight map is empty.

One built-in-engine application for the module: `max_num_seqs=1` (a second request queues in
the engine, so "before the first token" is a state that lasts), 300 ms between decode steps,
file:// images from a temporary directory (large JPEGs, so preprocessing takes a while), and
images from this host's loopback (a server that never finishes sending).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from tests.e2e.fault_support import wait_for, write_big_jpegs
from tests.conftest import deploy_app
from tests.support.dripping_image import DrippingImage
from tests.support.raw_http import reset, send_chat

pytestmark = pytest.mark.serve

NAME = "cancel"
STEP_MS = 300.0
CHAT = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cancel-images")
    write_big_jpegs(root)
    return root


@pytest.fixture(scope="module")
def app(serve_instance, image_dir):
    deployed = deploy_app(serve_instance, NAME, {
        "builtin_engine": {"step_interval_ms": STEP_MS, "max_num_seqs": 1},
        "images": {"allowed_local_dir": str(image_dir), "cache_bytes": 0,  # every request pays the pixel work
                   "allowed_hosts": ["127.0.0.1"]},
    })
    yield deployed
    serve.delete(NAME, _blocking=True)


@pytest.fixture
def dripping_image():
    image = DrippingImage()
    yield image
    image.close()




def _engine_idle_within(app, seconds: float) -> float:
    start = time.monotonic()
    wait_for(lambda: app.engine_utility("has_work") is False, seconds, "engine has no request left")
    return time.monotonic() - start


def _images_body(image_dir: Path, stream: bool = True, max_tokens: int = 3000) -> dict:
    content = [{"type": "text", "text": "Describe these."}] + [
        {"type": "image_url", "image_url": {"url": (image_dir / f"big{i}.jpg").as_uri()}} for i in range(4)
    ]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


def test_disconnect_before_first_token(app):
    """The request is queued in the engine behind another one (max_num_seqs=1) when its client
    leaves: the engine drops it, and nothing of it is left anywhere."""
    with httpx.stream("POST", app.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as keeper:
        lines = keeper.iter_lines()
        next(lines)  # the keeper holds the engine's only slot
        sent = app.engine_info().requests_sent
        sock = send_chat(app.base_url, {"messages": CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True})
        try:
            # Its ADD reached the engine, which queues it (no token yet).
            wait_for(lambda: app.engine_info().requests_sent == sent + 1, 10, "ADD sent")
            wait_for(lambda: app.engine_info().engine_waiting == 1, 2, "request queued in the engine")
        finally:
            left_at = time.monotonic()
            reset(sock)
        assert app.engine_info().num_in_flight in (1, 2)
        # Within 1 s: the engine reports one request (the keeper) and nothing waiting.
        wait_for(lambda: (i := app.engine_info()).engine_waiting == 0 and i.engine_running == 1 and i.num_in_flight == 1,
              1.0, "queued request aborted")
        assert time.monotonic() - left_at <= 1.0 + STEP_MS / 1000
    # Leaving the keeper's block closed it mid-stream.
    assert _engine_idle_within(app, 1.0) <= 1.0
    assert app.engine_info().num_in_flight == 0


def test_disconnect_mid_stream(app):
    with httpx.stream("POST", app.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        assert app.engine_utility("has_work") is True
    assert _engine_idle_within(app, 1.0) <= 1.0
    assert app.engine_info().num_in_flight == 0


def _preprocess_time(app, image_dir: Path) -> float:
    t0 = time.monotonic()
    r = httpx.post(app.base_url + "/v1/chat/completions", json=_images_body(image_dir, stream=False, max_tokens=1),
                   timeout=120)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_preprocessing(app, image_dir, stream):
    """Four 6000×6000 images: the client leaves while they are being preprocessed. No ADD is
    ever sent for the request (the engine client's count of ADDs does not move), the engine is
    idle, and the service stays usable."""
    took = _preprocess_time(app, image_dir)  # also warms up the path
    print(f"a request with four 6000x6000 images takes {took:.2f} s")
    # The client leaves a quarter of the way through (at most 0.3 s in): preprocessing must
    # last long enough for that to be "during" it, with a margin for the ingress's own work.
    assert took > 0.4, f"preprocessing too fast ({took:.2f} s) to disconnect during it"
    sent = app.engine_info().requests_sent
    sock = send_chat(app.base_url, _images_body(image_dir, stream=stream))
    time.sleep(min(0.3, took / 4))
    left_at = time.monotonic()
    reset(sock)
    assert app.engine_info().requests_sent == sent, "the engine request was sent before the client left"
    # Wait out the preprocessing (and then some): still no ADD, nothing running.
    while time.monotonic() - left_at < took + 2.0:
        info = app.engine_info()
        assert info.requests_sent == sent, f"an ADD was sent after the client had left ({info})"
        assert app.engine_utility("has_work") is False
        time.sleep(0.2)
    info = app.engine_info()
    assert info.num_in_flight == 0 and info.requests_sent == sent, info
    # Still serving.
    r = httpx.post(app.base_url + "/v1/chat/completions", timeout=60,
                   json={"messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_disconnect_during_an_image_fetch_cancels_the_fetch(app, dripping_image):
    """The client leaves while its image is still arriving over HTTP: the request went over the
    ingress's link, so the engine client called the preprocessor; the abort cancels that call,
    and with it the fetch (its connection hung up), long before the fetch's own 10-s timeout.
    Nothing reaches the engine."""
    warm = httpx.post(app.base_url + "/v1/chat/completions", timeout=60, json={"messages": CHAT, "max_tokens": 1})
    assert warm.status_code == 200, warm.text  # (the ingress's link to the engine client is open)
    before = app.engine_info()
    content = [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": dripping_image.url}}]
    sock = send_chat(app.base_url, {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": True})
    assert dripping_image.started.wait(20), "the image was never fetched"
    time.sleep(0.5)
    left_at = time.monotonic()
    reset(sock)
    assert dripping_image.hung_up.wait(5.0), "the fetch went on after the client left"
    print(f"the fetch hung up {time.monotonic() - left_at:.2f} s after the client left")
    after = app.engine_info()
    assert after.image_requests_received - before.image_requests_received == 1
    assert after.requests_sent == before.requests_sent
    assert after.num_in_flight == 0
