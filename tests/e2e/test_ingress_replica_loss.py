"""Losing an ingress replica behind HAProxy is no outage with two of them (as `cluster/`'s configs run):
one SIGKILLed (as the OOM killer does) under 16 streams costs only its own streams; the other replica's
streams end normally; every request sent after the kill is served; and the engine stops generating for
the dead replica's requests within 2 s (its running count back to the survivor's streams)."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import psutil
import pytest

from .serve_run_support import ServeRun

pytestmark = pytest.mark.serve

CHAT = "/v1/chat/completions"
STREAMS = 16
# 400 tokens of 20-ms steps: the streams run on well past the kill and the checks after it.
LONG = {"model": "mmserve-builtin", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
        "ignore_eos": True, "stream": True}


def _gauge(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def _ingress_replicas(run: ServeRun) -> dict[int, str]:
    """pid → own HTTP address of each ingress replica of `run` (each listens on a port of its own)."""
    replicas = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(process.info["cmdline"] or ())
        if not title.startswith("ray::ServeReplica:mmserve:Ingress"):
            continue
        try:
            if process.environ().get("RAY_TMPDIR") != str(run.tmp):
                continue
            ports = [c.laddr.port for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for port in ports:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    replicas[process.pid] = f"http://127.0.0.1:{port}"
                    break
            except httpx.HTTPError:
                continue
    return replicas


def test_two_ingress_replicas_one_killed_under_streams_costs_only_its_own():
    with ServeRun({"ingress_replicas": 2, "builtin_engine": {"step_interval_ms": 20.0}}) as run:
        deadline = time.monotonic() + 60
        while len(replicas := _ingress_replicas(run)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(replicas) == 2, replicas
        results: list[dict] = [{} for _ in range(STREAMS)]
        opened = threading.Barrier(STREAMS + 1)

        def stream(result: dict) -> None:
            try:
                with httpx.stream("POST", run.base_url + CHAT, json=LONG, timeout=60) as response:
                    lines = response.iter_lines()
                    next(lines)
                    opened.wait(timeout=60)
                    result["body"] = "\n".join(lines)
            except (httpx.HTTPError, StopIteration, threading.BrokenBarrierError) as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"

        threads = [threading.Thread(target=stream, args=(r,), daemon=True) for r in results]
        for thread in threads:
            thread.start()
        opened.wait(timeout=60)
        in_flight = {pid: _gauge(httpx.get(url + "/metrics", timeout=10).text, "mmserve_ingress_requests_in_flight")
                     for pid, url in replicas.items()}
        assert sum(in_flight.values()) == STREAMS, in_flight
        victim = max(in_flight, key=in_flight.get)
        [(survivor, survivor_url)] = [(pid, url) for pid, url in replicas.items() if pid != victim]
        survivors = in_flight[survivor]
        # The engine's count as the ingress last heard it from the engine client (at most a second old).
        deadline = time.monotonic() + 5
        while (engine_count := _gauge(httpx.get(survivor_url + "/metrics", timeout=10).text, "mmserve_engine_requests_in_flight")) != STREAMS:
            assert time.monotonic() < deadline, engine_count
            time.sleep(0.1)
        back: list[float] = []  # when the engine ran the survivor's streams only, seconds after the kill

        def watch_engine() -> None:
            while time.monotonic() - killed_at < 10:
                metrics = httpx.get(survivor_url + "/metrics", timeout=10).text
                # (+ 1: the new request sent meanwhile, if any)
                if _gauge(metrics, "mmserve_engine_requests_in_flight") <= survivors + 1:
                    back.append(time.monotonic() - killed_at)
                    return
                time.sleep(0.05)

        psutil.Process(victim).send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        watcher = threading.Thread(target=watch_engine, daemon=True)
        watcher.start()

        # New requests right after the kill: every one served (HAProxy to the survivor).
        statuses = []
        for _ in range(10):
            try:
                statuses.append(httpx.post(run.base_url + CHAT, timeout=30, json={
                    "model": "mmserve-builtin", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code)
            except httpx.HTTPError as exc:
                statuses.append(f"{type(exc).__name__}: {exc}")
        assert statuses == [200] * 10, statuses

        # The engine stops generating for the dead replica's requests.
        watcher.join(timeout=15)
        assert back and back[0] < 2.0, f"the engine still ran the dead replica's requests {back or 'after 10'} s after the kill"
        print(f"streams per replica {sorted(in_flight.values())}; the engine ran the survivor's only {back[0]:.2f} s after the kill")

        for thread in threads:
            thread.join(timeout=60)
        ended = [r for r in results if "error" not in r and "[DONE]" in r.get("body", "")]
        cut = [r for r in results if r not in ended]
        assert len(ended) == survivors and len(cut) == in_flight[victim], (in_flight, [r.get("error") for r in cut])
