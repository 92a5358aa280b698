"""Logs and metrics tell the truth about clients, under a real `serve run` (not pytest's Ray):
one `mmserve.requests` JSON line per request in the ingress replica's log file (and none on the
console), refused requests and client disconnects never an ERROR or a traceback in any replica, and
/metrics counting a disconnect as 499 (client closed), never 500."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
import socket
import time
from pathlib import Path

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
        # Straight to the ingress replica: HAProxy 2.8 does not always pass on the leaving of a
        # client that waits for a whole answer (docs/operations.md, "HAProxy: ports, stopping, a known limit").
        with pytest.raises(httpx.TimeoutException):
            httpx.post(serve_run.ingress_replica_url() + CHAT, json=long_chat, timeout=1.0)
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
    # One line per request, the request line, in the ingress replica's log file only: no access line
    # of Serve's (none per call between replicas either), and nothing per request on the console, where
    # each line would be read by Ray's log monitor, published through GCS and printed by the driver (issue 16).
    assert "POST /v1/chat/completions" not in serve_run.replica_logs("Ingress")
    console = serve_run.log_path.read_text(errors="replace") + serve_run.worker_stderr()
    assert "request {" not in console and "POST /v1/chat/completions" not in console, console[-3000:]
    assert "mmserve ingress serving" in console  # (the replica's other lines still reach it)
    assert "CALL add" not in serve_run.replica_logs("EngineClient0")
    assert "CALL process" not in serve_run.replica_logs("Preprocessor")


def _builtin_engine_pids(run) -> list[int]:
    """The built-in engine processes of this `serve run` (found by its own RAY_TMPDIR)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"mmserve.builtin_engine" in cmdline and f"RAY_TMPDIR={run.tmp}".encode() in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


async def _streams(url: str, n: int, on_open) -> list[int]:
    """`n` streamed chats; `on_open(stream)` decides when each client leaves. Their HTTP statuses."""
    long_chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=n)) as client:
        async def one() -> int:
            async with client.stream("POST", CHAT, json=long_chat) as stream:
                if stream.status_code != 200:
                    return (stream.status_code, (await stream.aread())[:300])
                await on_open(stream)
                return stream.status_code
        return await asyncio.gather(*(one() for _ in range(n)))


def test_disconnects_and_an_engine_death_leave_one_info_line_each_and_no_traceback(serve_run):
    url = serve_run.base_url
    before = len(request_log_lines(serve_run.replica_logs("Ingress")))

    async def leave_after_three_events(stream) -> None:
        events = 0
        async for line in stream.aiter_lines():
            events += line.startswith("data:")
            if events == 3:
                return  # closing the response mid-stream: the client is gone

    statuses = asyncio.run(_streams(url, 50, leave_after_three_events))
    assert statuses == [200] * 50, (statuses, serve_run.replica_logs("EngineClient0")[-4000:])

    # 15 streams in flight when the engine dies: each gets an error event, then the stream ends.
    [pid] = _builtin_engine_pids(serve_run)
    started = asyncio.Event()
    opened = 0

    async def read_to_the_end(stream) -> None:
        nonlocal opened
        events = 0
        async for line in stream.aiter_lines():
            if not line.startswith("data:"):
                continue
            events += 1
            if events == 2:
                opened += 1
                if opened == 15:
                    started.set()

    async def kill_when_all_stream() -> list[int]:
        streams = asyncio.ensure_future(_streams(url, 15, read_to_the_end))
        await asyncio.wait_for(started.wait(), 60)
        os.kill(pid, signal.SIGKILL)
        return await streams

    statuses = asyncio.run(kill_when_all_stream())
    assert statuses == [200] * 15, (statuses, serve_run.replica_logs("EngineClient0")[-4000:])

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = request_log_lines(serve_run.replica_logs("Ingress"))[before:]
        if len(lines) >= 65:
            break
        time.sleep(0.5)
    assert len(lines) == 65, lines
    assert sorted(line["status"] for line in lines[:50]) == [499] * 50
    died = lines[50:]
    assert all(line["outcome"] == "error" and "engine" in (line["error"] or "") for line in died), died

    # The engine client starts a new built-in engine in place of the dead one; the app serves again.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    again = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, timeout=60)
    assert again.status_code == 200, again.text
    logs = serve_run.all_serve_logs() + serve_run.worker_stderr()
    # Not even Serve's controller: the engine client replaces its engine in place, so no health
    # check fails (each failed check would log a traceback, and the controller an ERROR).
    bad = [line for line in logs.splitlines()
           if re.match(r"(ERROR|CRITICAL)\b", line) or "Traceback" in line or "never retrieved" in line]
    assert not bad, "\n".join(bad[:60])
    # The engine's death: said once, with its reason, by its engine client.
    deaths = [line for line in serve_run.replica_logs("EngineClient0").splitlines() if "engine declared dead" in line]
    assert len(deaths) == 1, "\n".join(deaths)  # whole lines: pytest would cut them short


def test_an_ingress_with_the_applications_own_options_does_not_warn_of_its_runtime_env(serve_run):
    """The counterpart of `test_serve_run_ingress_env.py`: no warning when nothing replaced the
    Ingress's runtime_env."""
    assert "this ingress replica runs without" not in serve_run.replica_logs("Ingress")
