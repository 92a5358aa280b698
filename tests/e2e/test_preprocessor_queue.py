"""`preprocessor.max_queued_requests`: image requests beyond the preprocessing tier's queue are
answered at once with a 503 and `Retry-After`, in OpenAI's error shape, while the ones it holds wait
their turn; the engine receives none of the refused. (The queue is the replica's own,
`ReplicaAdmission`: its requests come over the preprocessing link and as Serve calls.)"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import deploy_app
from tests.support.dripping_image import DrippingImage

pytestmark = pytest.mark.serve

NAME = "preprocessor-queue"


def test_image_requests_past_the_preprocessing_queue_get_503_at_once(serve_instance):
    from ray import serve

    app = deploy_app(serve_instance, NAME, {
        # One replica taking one request at a time, one more waiting: the third and later are past the queue.
        "preprocessor": {"min_replicas": 1, "max_replicas": 1, "max_ongoing_requests": 1, "max_queued_requests": 1},
        "images": {"allowed_hosts": ["127.0.0.1"], "fetch_timeout_s": 3.0},
    })
    image = DrippingImage()  # each fetch of it lasts until the fetch's 3-s timeout
    try:
        url = app.base_url + "/v1/chat/completions"
        warm = httpx.post(url, timeout=60, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert warm.status_code == 200, warm.text  # (the ingress's link to the engine client is open)
        sent_before = app.engine_info().requests_sent
        body = {"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": image.url}}]}]}

        async def one(client: httpx.AsyncClient, delay_s: float) -> tuple[int, float, httpx.Response]:
            await asyncio.sleep(delay_s)  # in order: the first two take the replica and the queue
            started = time.monotonic()
            response = await client.post(url, json=body)
            return response.status_code, time.monotonic() - started, response

        async def burst():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(one(client, 0.3 * (i > 0) + 0.1 * i) for i in range(5)))

        results = asyncio.run(burst())
        print([(status, round(took, 2)) for status, took, _ in results])
        refused = [(took, response) for status, took, response in results if status == 503]
        assert len(refused) >= 2, [(status, response.text[:200]) for status, _, response in results]
        for took, response in refused:
            assert took < 2.0  # at once, not after a fetch's timeout
            assert response.headers.get("retry-after") == "1"
            error = response.json()["error"]
            assert "preprocessing queue is full" in error["message"] and error["type"], error
        # The ones it held were processed (their image is no image: a 400 naming it), none refused reached the engine.
        assert all(status in (400, 503) for status, _, _ in results), [r[:2] for r in results]
        assert app.engine_info().requests_sent == sent_before
    finally:
        image.close()
        serve.delete(NAME, _blocking=True)
