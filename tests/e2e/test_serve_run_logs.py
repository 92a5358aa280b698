"""Logs and metrics tell the truth about clients, under a real `serve run` (not pytest's Ray):
one `mmserve.requests` JSON line per request in the ingress replica's log file, refused requests
and client disconnects never an ERROR or a traceback in any replica, and /metrics counting a
disconnect as 499 (client closed), never 500."""

from __future__ import annotations

import base64
import json
import re
import socket
import time

import httpx
import pytest

from .serve_run_support import ServeRun, request_log_lines

pytestmark = pytest.mark.serve

CHAT = "/v1/chat/completions"


def _image_chat(url: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": 4, **extra}


@pytest.fixture(scope="module")
def serve_run():
    # A slow built-in engine (50 ms per step) so that clients can leave mid-generation.
    with ServeRun({"builtin_engine": {"step_interval_ms": 50.0}, "limits": {"max_messages": 8}}) as run:
        yield run


def _metric(text: str, status: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("mmserve_requests_total{") and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_request_lines_metrics_and_no_tracebacks_for_client_mistakes(serve_run):
    url = serve_run.base_url
    expected: list[int] = []
    with httpx.Client(base_url=url, timeout=60) as client:
        ok = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        expected.append(200)
        junk = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
        for body in (_image_chat(junk), _image_chat(junk, stream=True), _image_chat("http://127.0.0.1:9/cat.png")):
            resp = client.post(CHAT, json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text
            expected.append(400)
        resp = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}] * 9})
        assert resp.status_code == 400 and "max_messages" in resp.json()["error"]["message"], resp.text
        expected.append(400)
        resp = client.post(CHAT, content=b'{"messages": "' + b"a" * (5 * 1024 * 1024) + b'"}',
                           headers={"content-type": "application/json"})
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large", resp.text
        expected.append(413)
        # A client that leaves a stream after its first chunk, and one that gives up on a
        # non-streamed answer (100 tokens take 5 s here).
        long_chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "ignore_eos": True}
        with client.stream("POST", CHAT, json=long_chat | {"stream": True}) as stream:
            for _ in stream.iter_lines():
                break
        expected.append(499)
        with pytest.raises(httpx.TimeoutException):
            client.post(CHAT, json=long_chat, timeout=1.0)
        expected.append(499)
    # And one that leaves halfway through sending its body.
    with socket.create_connection(("127.0.0.1", serve_run.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b'{"messages": [' + b" " * 1000)
        time.sleep(1.0)
    expected.append(499)

    # Lines and metrics are written when the requests end (the engine aborts the abandoned ones).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = request_log_lines(serve_run.replica_logs("Ingress"))
        if len(lines) >= len(expected):
            break
        time.sleep(0.5)
    statuses = sorted(line["status"] for line in lines)
    assert statuses == sorted(expected), (statuses, serve_run.replica_logs("Ingress")[-3000:])
    for line in lines:
        assert {"request_id", "endpoint", "status", "outcome", "total_ms", "error"} <= set(line)
    assert [line["outcome"] for line in lines if line["status"] == 499] == ["client_closed"] * 3

    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert _metric(metrics, "499") == 3 and _metric(metrics, "500") == 0, metrics
    assert _metric(metrics, "400") == 4 and _metric(metrics, "413") == 1 and _metric(metrics, "200") == 1

    logs = serve_run.all_serve_logs() + serve_run.worker_stderr()
    bad = [line for line in logs.splitlines()
           if re.match(r"(ERROR|CRITICAL)\b", line) or "Traceback" in line or "never retrieved" in line
           or "TaskCancelledError" in line]
    assert not bad, "\n".join(bad[:40])
    # The refused image left one INFO line in the preprocessor, naming it.
    assert serve_run.replica_logs("Preprocessor").count("image refused:") == 3
