"""Engines added and removed while serving (issue 20): each a Serve application of its own
(`serve_app:build_engine_app`), taken in by the mmserve application whose `engine_applications`
prefix its name starts with, drained when it is deleted; nothing else restarts."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from tests.conftest import deploy_app
from tests.e2e.fault_support import wait_for
from tests.support.images import image_part, image_uri

pytestmark = pytest.mark.serve

BUILTIN = "mmserve-builtin"
PREFIX = "engapps-engine-"
STEP_MS = 20.0  # 300 tokens: a 6-s stream


def _deploy_engine(name: str) -> None:
    from serve_app import build_engine_app

    serve.run(build_engine_app({"builtin_engine": {"step_interval_ms": STEP_MS}}), name=name, route_prefix=None, blocking=False)


def _engine(name: str):
    return serve.get_deployment_handle("EngineClient0", app_name=name)


def _requests_sent(name: str) -> int:
    return _engine(name).info.remote().result(timeout_s=30).requests_sent


def _listed(base_url: str) -> dict[str, str]:
    return {e["engine"]: e["state"] for e in httpx.get(base_url + "/health", timeout=30).json()["engines"]}


async def _stream(client: httpx.AsyncClient, url: str, tokens: int, n: int) -> tuple[int, int]:
    body = {"model": BUILTIN, "messages": [{"role": "user", "content": f"request {n}"}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    received = 0
    async with client.stream("POST", url, json=body, timeout=120) as response:
        if response.status_code != 200:
            return response.status_code, 0
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 500, received
                if chunk.get("usage"):
                    received = chunk["usage"]["completion_tokens"]
    return 200, received


def test_engine_applications_join_and_leave_while_serving_and_nothing_else_restarts(serve_instance):
    """An engine application deployed while the service runs is routed to within seconds; one
    deleted while streams run on it is drained: its streams finish whole, new requests go to the
    other, and Serve stops it once they are done. The ingress and the other engine are the same
    processes throughout."""
    import ray

    name = "engapps"
    a, b = PREFIX + "a", PREFIX + "b"
    _deploy_engine(a)
    try:
        app = deploy_app(serve_instance, name, {"engines": [], "engine_applications": PREFIX, "served_model_name": BUILTIN})
        url = app.base_url + "/v1/chat/completions"
        assert _listed(app.base_url) == {a: "ready"}
        # An image request over the link: the engine application's engine client calls this
        # application's preprocessor (another Serve application's deployment) itself.
        client = app.openai()
        client.chat.completions.create(model=BUILTIN, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        images_before = _engine(a).info.remote().result(timeout_s=30).image_requests_received
        answer = client.chat.completions.create(model=BUILTIN, max_tokens=2, messages=[
            {"role": "user", "content": [image_part(image_uri(64, 48, seed=1)), {"type": "text", "text": "What is it?"}]}])
        assert answer.choices[0].finish_reason == "length"
        assert _engine(a).info.remote().result(timeout_s=30).image_requests_received == images_before + 1
        ingress_pid = serve.get_deployment_handle("Ingress", app_name=name).pid.remote().result(timeout_s=30)
        engine_a_pid = _engine(a).pid.remote().result(timeout_s=30)

        _deploy_engine(b)  # added while serving: no `serve deploy` of the mmserve application
        wait_for(lambda: _listed(app.base_url) == {a: "ready", b: "ready"}, 60, "the new engine application routed to")
        engine_b_pid = _engine(b).pid.remote().result(timeout_s=30)

        async def scenario() -> dict:
            async with httpx.AsyncClient() as client:
                sent_before = {e: await asyncio.to_thread(_requests_sent, e) for e in (a, b)}
                long_streams = [asyncio.create_task(_stream(client, url, 300, n)) for n in range(4)]
                await asyncio.sleep(1.0)
                on_a = await asyncio.to_thread(_requests_sent, a) - sent_before[a]
                deleted_at = time.monotonic()
                await asyncio.to_thread(serve.delete, a, _blocking=False)
                later = []
                while not all(t.done() for t in long_streams):
                    later.append(await _stream(client, url, 4, 100 + len(later)))
                    await asyncio.sleep(0.2)
                done = await asyncio.gather(*long_streams)
                return {"on_a": on_a, "long": done, "later": later, "streams_done_after_s": time.monotonic() - deleted_at}

        result = asyncio.run(scenario())
        print(f"engine applications: {result}")
        assert result["on_a"] >= 1  # (spread by load over the two engines)
        assert result["long"] == [(200, 300)] * 4, result["long"]  # the streams on the deleted engine finished whole
        assert result["later"] and all(status == (200, 4) for status in result["later"]), result["later"]
        # Serve stops the drained engine application once its streams are done, not at the drain timeout.
        wait_for(lambda: a not in serve.status().applications, 30, "the deleted engine application gone")
        assert _listed(app.base_url) == {b: "ready"}
        logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
        drained = [line for path in logs.glob(f"replica_{name}_Ingress_*.log") for line in path.read_text(errors="replace").splitlines()
                   if f"engine {a} is being taken away: draining its" in line]
        assert drained, "the ingress did not drain the deleted engine application"
        # Nothing else was restarted.
        assert serve.get_deployment_handle("Ingress", app_name=name).pid.remote().result(timeout_s=30) == ingress_pid
        assert _engine(b).pid.remote().result(timeout_s=30) == engine_b_pid
        assert engine_a_pid != engine_b_pid
    finally:
        for app_name in (name, a, b):
            try:
                serve.delete(app_name, _blocking=True)
            except Exception:
                pass


def test_an_engine_application_is_one_engine():
    from serve_app import build_engine_app

    with pytest.raises(ValueError, match="one engine"):
        build_engine_app({"engines": ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]})
    with pytest.raises(ValueError, match="belong to the mmserve application"):
        build_engine_app({"engine_pool": {}})


def test_no_engines_is_refused_unless_they_come_from_engine_applications():
    from pydantic import ValidationError

    from serve_app.config import AppConfig

    with pytest.raises(ValidationError, match="engines is empty"):
        AppConfig.model_validate({"engines": []})
    assert AppConfig.model_validate({"engines": [], "engine_applications": PREFIX}).engine_endpoints() == []
