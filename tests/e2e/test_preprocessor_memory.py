"""The preprocessor gives back the memory heavy decodes took, once it is idle, as the ingress does with
large bodies: glibc would otherwise keep the freed pixels of its decoding threads in their arenas."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import numpy as np
import psutil
import pytest
from PIL import Image
from ray import serve

pytestmark = pytest.mark.serve

MB = 1024 * 1024


def _big_jpeg_uri(seed: int, size: tuple[int, int] = (3000, 2000)) -> str:
    """A 6-MP JPEG of a few hundred KB (smooth: noise scaled up), distinct per seed."""
    small = np.random.default_rng(seed).integers(0, 256, (size[1] // 10, size[0] // 10, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize(size, Image.BILINEAR).save(buf, "JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _body(*uris: str) -> dict:
    content = [{"type": "text", "text": "What is this?"}] + [{"type": "image_url", "image_url": {"url": u}} for u in uris]
    return {"model": "mmserve-builtin", "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def test_the_preprocessor_returns_heavy_decodes_memory_once_idle(builtin_app):
    pid = serve.get_deployment_handle("Preprocessor", app_name=builtin_app.name).pid.remote().result(timeout_s=30)
    replica = psutil.Process(pid)
    url = builtin_app.base_url + "/v1/chat/completions"
    assert httpx.post(url, json=_body(_big_jpeg_uri(10_000)), timeout=120).status_code == 200  # warm
    time.sleep(2)
    before = replica.memory_info().rss

    async def load() -> list[int]:
        async with httpx.AsyncClient(timeout=180) as client:
            answers = await asyncio.gather(*(client.post(url, json=_body(_big_jpeg_uri(2 * i), _big_jpeg_uri(2 * i + 1)))
                                             for i in range(12)))
        return [a.status_code for a in answers]

    uris_rss = replica.memory_info().rss
    assert asyncio.run(load()) == [200] * 12
    peak = replica.memory_info().rss
    time.sleep(3)
    after = replica.memory_info().rss
    print(f"preprocessor RSS: {before / MB:.0f} MB before, {peak / MB:.0f} MB after 24 decodes of 6 MP, {after / MB:.0f} MB 3 s later")
    assert after - before < 64 * MB, (before / MB, uris_rss / MB, peak / MB, after / MB)
