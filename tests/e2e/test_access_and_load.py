"""API keys, bind addresses, metrics and back-pressure, each with a test that fails without its rule."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from pydantic import ValidationError

from serve_app.config import AppConfig, EngineEndpoint
from tests.support.dripping_image import DrippingImage
from tests.conftest import deploy_app

pytestmark = pytest.mark.serve

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def test_api_key_is_required_and_compared_exactly(serve_instance):
    from ray import serve

    app = deploy_app(serve_instance, "apikey", {"api_key": "s3cret-key"})
    try:
        url = app.base_url + "/v1/chat/completions"
        assert httpx.post(url, json=CHAT, timeout=30).status_code == 401
        for wrong in ("Bearer s3cret-kez", "Bearer s3cret-key-longer", "Basic s3cret-key", "s3cret-key", "Bearer x"):
            resp = httpx.post(url, json=CHAT, headers={"Authorization": wrong}, timeout=30)
            assert resp.status_code == 401, wrong
            assert resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(app.base_url + "/v1/models", timeout=30).status_code == 401
        ok = httpx.post(url, json=CHAT, headers={"Authorization": "Bearer s3cret-key"}, timeout=30)
        assert ok.status_code == 200, ok.text
        # The openai client sends the key the same way.
        import openai

        client = openai.OpenAI(base_url=app.base_url + "/v1", api_key="s3cret-key", max_retries=0)
        assert client.chat.completions.create(model="mmserve-builtin", **CHAT).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=app.base_url + "/v1", api_key="nope", max_retries=0).models.list()
        # Health stays open for load balancers.
        assert httpx.get(app.base_url + "/health", timeout=30).status_code == 200
    finally:
        serve.delete("apikey", _blocking=True)


@pytest.mark.parametrize("address", ["tcp://*:29550", "tcp://0.0.0.0:29550", "tcp://[::]:29550"])
def test_engine_sockets_never_bind_all_interfaces_unless_asked(address):
    with pytest.raises(ValidationError, match="every network interface"):
        EngineEndpoint(handshake=address)
    with pytest.raises(ValidationError):
        AppConfig.model_validate({"engines": [address]})
    with pytest.raises(ValidationError):
        EngineEndpoint(handshake="tcp://127.0.0.1:29550", inputs=address)
    assert EngineEndpoint(handshake=address, allow_all_interfaces=True).handshake == address
    # Defaults are loopback.
    assert AppConfig().builtin_engine.handshake.startswith("tcp://127.0.0.1:")


def test_engine_client_binds_exactly_the_configured_address():
    import zmq

    from mmserve.engine import EngineAddresses
    from mmserve.engine.transport import EngineTransport

    transport = EngineTransport(EngineAddresses("tcp://127.0.0.1:0"))
    try:
        for address in (transport.handshake_address, transport.input_address, transport.output_address):
            assert address.startswith("tcp://127.0.0.1:")
        endpoints = [s.getsockopt(zmq.LAST_ENDPOINT).decode() for s in (transport._handshake, transport._inputs, transport._outputs)]
        assert all(e.startswith("tcp://127.0.0.1:") for e in endpoints), endpoints
    finally:
        transport.close()


def _sample(text: str, name: str) -> float:
    """The value of an unlabelled sample (its line is exported, 0, before anything is observed)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_metrics_and_request_log(builtin_app):
    from tests.support.images import image_uri

    metrics = builtin_app.base_url + "/metrics"
    before = httpx.get(metrics, timeout=30).text
    client = builtin_app.openai()
    # 64 tokens at the engine's 2 ms a step: the Ingress takes them in more than one batch even on a
    # loaded machine (a short answer can arrive merged into one batch, and then no gap is observed).
    client.chat.completions.create(model="mmserve-builtin", **{**CHAT, "max_tokens": 64}, extra_body={"ignore_eos": True})
    httpx.post(builtin_app.base_url + "/v1/chat/completions", json={**CHAT, "temperature": 9}, timeout=30)
    client.chat.completions.create(model="mmserve-builtin", max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": image_uri(64, 48, seed=3)}}]}])
    text = httpx.get(metrics, timeout=30).text
    assert 'mmserve_requests_total{endpoint="chat",status="200"}' in text
    assert 'mmserve_requests_total{endpoint="chat",status="400"}' in text
    # Observed by these requests, not merely exported: the counts grew.
    for name, grew_by in (("mmserve_time_to_first_token_seconds_count", 2), ("mmserve_inter_token_latency_seconds_count", 1),
                          ("mmserve_preprocess_seconds_per_image_count", 1)):
        assert _sample(text, name) - _sample(before, name) >= grew_by, name
    assert 'mmserve_engine_ready{engine="0"} 1.0' in text
    assert 'mmserve_engine_bytes_sent{engine="0"}' in text


def test_request_log_line_fields():
    from mmserve.openai.metrics import Metrics, RequestRecord

    record = RequestRecord("chat", stream=True, request_id="chatcmpl-1", prompt_tokens=3, completion_tokens=2)
    record.first_token_at = record.started + 0.01
    fields = record.log_fields()
    assert {"request_id", "status", "outcome", "ttft_ms", "total_ms", "prompt_tokens", "completion_tokens"} <= set(fields)
    json.dumps(fields)
    Metrics().observe_finished(record)


def test_in_flight_limit_gives_429_not_timeouts(serve_instance):
    from ray import serve

    app = deploy_app(serve_instance, "limited", {"limits": {"max_in_flight_per_engine": 4},
                                                 "builtin_engine": {"step_interval_ms": 20},
                                                 "images": {"allowed_hosts": ["127.0.0.1"]}})
    image = DrippingImage()
    try:
        async def one(client: httpx.AsyncClient) -> tuple[int, str | None]:
            resp = await client.post(app.base_url + "/v1/chat/completions", json={**CHAT, "max_tokens": 50, "ignore_eos": True})
            return resp.status_code, resp.headers.get("retry-after")

        async def burst() -> list[tuple[int, str | None]]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(one(client) for _ in range(16)))

        results = asyncio.run(burst())
        codes = [c for c, _ in results]
        assert codes.count(200) >= 4 and codes.count(429) >= 1, codes
        assert set(codes) <= {200, 429}
        assert all(retry for code, retry in results if code == 429)

        # With the engine full, an image request (over the ingress's link, open since the burst) is
        # refused before its image is fetched: the limit comes before the expensive step.
        async def full_engine_then_image() -> tuple[int, int]:
            async with httpx.AsyncClient(timeout=60) as client:
                long = [asyncio.create_task(client.post(app.base_url + "/v1/chat/completions", json={**CHAT, "max_tokens": 400, "ignore_eos": True}))
                        for _ in range(4)]
                while (await asyncio.to_thread(app.engine_info)).num_in_flight < 4:
                    await asyncio.sleep(0.05)
                body = {"max_tokens": 4, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": image.url}}]}]}
                refused = await client.post(app.base_url + "/v1/chat/completions", json=body)
                for task in long:
                    task.cancel()
                await asyncio.gather(*long, return_exceptions=True)
                return refused.status_code, (await asyncio.to_thread(app.engine_info)).image_requests_received

        images_before = app.engine_info().image_requests_received
        status, images_after = asyncio.run(full_engine_then_image())
        assert status == 429
        assert images_after == images_before + 1  # (it went over the link, to the engine client's check)
        assert not image.started.is_set(), "the image was fetched for a request the full engine refused"
    finally:
        image.close()
        serve.delete("limited", _blocking=True)


async def _warm_up(app) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(client.post(app.base_url + "/v1/chat/completions", json=CHAT) for _ in range(20)))


def test_500_concurrent_streams_complete(builtin_app):
    """500 concurrent streaming requests: all complete, no errors, bounded memory."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"messages": [{"role": "user", "content": f"stream {i}"}], "max_tokens": 32, "ignore_eos": True, "stream": True}
        tokens = 0
        async with client.stream("POST", builtin_app.base_url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    payload = json.loads(line[6:])
                    assert "error" not in payload, payload
                    tokens += sum(1 for c in payload["choices"] if c.get("delta", {}).get("content"))
        return tokens

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=600)
        async with httpx.AsyncClient(timeout=180, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(500)))

    import psutil
    from ray import serve

    ingress_pid = serve.get_deployment_handle("Ingress", app_name=builtin_app.name).pid.remote().result(timeout_s=30)
    engine_client_pid = builtin_app.engine_handle().pid.remote().result(timeout_s=30)
    builtin_pid = builtin_app.engine_info().builtin_pid
    pids = {"ingress": ingress_pid, "engine client": engine_client_pid, "built-in engine": builtin_pid}

    def rss() -> dict[str, int]:
        return {name: psutil.Process(pid).memory_info().rss for name, pid in pids.items()}

    asyncio.run(_warm_up(builtin_app))
    before = rss()
    started = time.monotonic()
    results = asyncio.run(run())
    after = rss()
    assert len(results) == 500 and all(r > 0 for r in results)
    assert time.monotonic() - started < 180
    assert builtin_app.engine_info().num_in_flight == 0
    # Memory stays bounded: 500 concurrent streams may not grow any gateway process by more
    # than 300 MB (per-request state is a few KB; an unbounded queue or leak would show here).
    for name in pids:
        assert after[name] - before[name] < 300 * 1024 * 1024, (name, before[name], after[name])
