"""Abusive bodies, scaled down: every limit of the intake is sent past, each abusive request
gets a 4xx/503 in OpenAI's error shape, and small chats keep being served and lose nothing while
it happens. Functional only: latency and memory under the full-size abuse are measured by
bench/abuse_bench.py (bench/RESULTS.md), never asserted here."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import pytest
from PIL import Image

from tests.conftest import deploy_app

pytestmark = pytest.mark.serve

KiB, MiB = 1024, 1024 * 1024
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LIMITS = {
    "max_request_bytes": 256 * KiB,
    "max_messages": 64,
    "max_stop_strings": 4,
    "ingress_body_budget_bytes": 3 * MiB,  # one 1.3 MB image body (charged twice) fits, two do not
    "small_request_bytes": 16 * KiB,
    "body_read_timeout_s": 4.0,
}
IMAGES = {"max_images_per_request": 2, "max_image_bytes": 1 * MiB}


@pytest.fixture(scope="module")
def abuse_app(serve_instance):
    return deploy_app(serve_instance, "abuse", {"builtin_engine": {"step_interval_ms": 2.0}, "limits": LIMITS, "images": IMAGES})


def _png_uri(size: int = 32) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _bodies() -> dict[str, tuple[str, bytes, tuple[int, ...]]]:
    """name -> (route, body, acceptable statuses)."""
    big_text = "lorem ipsum " * (40 * KiB)  # ≈480 KiB: past the 256 KiB text cap
    oversize_image = "data:image/png;base64," + "A" * (1400 * KiB)  # past max_image_bytes, base64-inflated
    cases = {
        "text-prompt": (CHAT, {"messages": [{"role": "user", "content": big_text}]}, (413,)),
        "completion-prompt": (COMPLETIONS, {"prompt": big_text}, (413,)),
        "stop-strings": (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": ["x" * 100] * 5000}, (413,)),
        "many-messages": (CHAT, {"messages": [{"role": "user", "content": "a"}] * 20_000}, (413,)),
        "image-data-uri": (CHAT, {"messages": [{"role": "user", "content": [_image_part(oversize_image)]}]}, (413,)),
        "too-many-images": (CHAT, {"messages": [{"role": "user", "content": [_image_part(_png_uri())] * 3}]}, (413,)),
        # Below the byte caps, past the counts: refused while decoding.
        "messages-count": (CHAT, {"messages": [{"role": "user", "content": "a"}] * 65}, (400,)),
        "stop-count": (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, (400,)),
        # Text hidden next to an image, past the text cap.
        "text-beside-image": (CHAT, {"messages": [{"role": "user", "content": [
            _image_part(_png_uri()), {"type": "text", "text": big_text}]}]}, (413,)),
        # Within the caps, more characters than the context can hold (4096 tokens): refused before tokenizing.
        "prompt-chars": (COMPLETIONS, {"prompt": "z" * (200 * KiB)}, (400,)),
    }
    out = {name: (route, json.dumps(body).encode(), statuses) for name, (route, body, statuses) in cases.items()}
    out["malformed-json"] = (CHAT, b'{"messages": [' + b"{" * (512 * KiB), (413,))
    out["malformed-small"] = (CHAT, b'{"messages": [{"role": "user", "content": "hi"' + b"]" * 1000, (400,))
    return out


def _assert_openai_error(resp: httpx.Response, name: str) -> dict:
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"{name}: not OpenAI's error shape: {resp.status_code} {resp.text[:200]}") from None
    assert set(error) >= {"message", "type", "param", "code"} and error["message"], (name, error)
    return error


def test_every_limit_refuses_with_an_openai_error(abuse_app):
    with httpx.Client(base_url=abuse_app.base_url, timeout=60) as client:
        for name, (route, body, statuses) in _bodies().items():
            resp = client.post(route, content=body, headers={"content-type": "application/json"})
            assert resp.status_code in statuses, (name, resp.status_code, resp.text[:300])
            _assert_openai_error(resp, name)
        # Chunked (no Content-Length): the cap holds while streaming.
        def chunks():
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(64):
                yield b"a" * (8 * KiB)
            yield b'"}]}'
        resp = client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
        assert resp.status_code == 413, resp.text[:300]
        _assert_openai_error(resp, "chunked")


async def _slow_body(base_url: str, declared: int, sent: int) -> int:
    """Declares a large image body, sends `sent` bytes of it at once and then nothing: it holds
    that much of the byte budget until the body read timeout answers it (the status returned)."""
    prefix = b'{"messages": [{"role": "user", "content": [' + json.dumps(_image_part("data:image/png;base64,")).encode()[:-3]
    url = httpx.URL(base_url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write((f"POST {url.path.rstrip('/')}{CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {declared}\r\n\r\n").encode() + prefix + b"A" * (sent - len(prefix)))
    await writer.drain()
    try:
        status_line = await asyncio.wait_for(reader.readline(), timeout=LIMITS["body_read_timeout_s"] + 30)
        return int(status_line.split()[1])
    finally:
        writer.close()


async def _abuse_with_probe(base_url: str) -> tuple[list[int], list[int], list[tuple[str, int]]]:
    probe_statuses: list[int] = []
    stop = asyncio.Event()

    async def probe(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            resp = await client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            probe_statuses.append(resp.status_code)
            await asyncio.sleep(0.05)

    async def abusive(client: httpx.AsyncClient, name: str, route: str, body: bytes) -> tuple[str, int]:
        resp = await client.post(route, content=body, headers={"content-type": "application/json"})
        if resp.status_code >= 400:
            _assert_openai_error(resp, name)
        if resp.status_code == 503:
            assert resp.headers.get("retry-after"), name
        return name, resp.status_code

    big_image_body = json.dumps({"messages": [{"role": "user", "content": [
        _image_part("data:image/png;base64," + "A" * (1300 * KiB))]}]}).encode()  # 1.3 MB, > small, valid size
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        probe_task = asyncio.create_task(probe(client))
        # A slow body holds what it has sent, 1.5 MB (declaring 1.55 MB, which would fit idle):
        # beside it, a 1.3 MB body cannot be parsed (charged twice) until it is gone.
        slow = [asyncio.create_task(_slow_body(base_url, 1_550_000, 1_500_000))]
        await asyncio.sleep(0.5)
        semaphore = asyncio.Semaphore(5)

        async def limited(*args):
            async with semaphore:
                return await abusive(client, *args)

        jobs = [limited("budget", CHAT, big_image_body) for _ in range(4)]  # first: while the slow body holds
        jobs += [limited(name, route, body) for name, (route, body, _) in _bodies().items() for _ in range(2)]
        results = await asyncio.gather(*jobs)
        slow_statuses = await asyncio.gather(*slow)
        stop.set()
        await probe_task
    return probe_statuses, slow_statuses, results


def test_small_chats_are_served_while_abusive_bodies_are_refused(abuse_app):
    probe, slow, results = asyncio.run(_abuse_with_probe(abuse_app.base_url))
    assert probe and all(status == 200 for status in probe), probe
    for name, status in results:
        assert 400 <= status < 600 and status != 500, (name, status)
    # While the slow body held the budget, large bodies were turned away at once with 503; the
    # slow body itself got 408 when its read timeout ran out.
    assert ("budget", 503) in results, results
    assert slow == [408], slow
    # Once the budget is free again a large body is admitted (and refused only for not being an image).
    with httpx.Client(base_url=abuse_app.base_url, timeout=60) as client:
        body = json.dumps({"messages": [{"role": "user", "content": [
            _image_part("data:image/png;base64," + "A" * (1300 * KiB))]}]}).encode()
        resp = client.post(CHAT, content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text[:300]
