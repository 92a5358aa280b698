"""However `serve run` is stopped — Ctrl+C, SIGTERM to it or to its process group, Ctrl+C then SIGKILL
(a supervisor's stop timeout), SIGKILL to the group — nothing of it keeps running or holds a port (its
HAProxy included, which lives in a process group of its own), and the next `serve run` serves."""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import psutil
import pytest

from serve_app import leftovers

from .serve_run_support import ServeRun

pytestmark = pytest.mark.serve

ARGS = {"builtin_engine": {"step_interval_ms": 5.0}}


def _sigterm(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)


def _sigterm_group(pid: int) -> None:
    os.killpg(pid, signal.SIGTERM)


def _ctrl_c_then_sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGINT)
    time.sleep(8)
    os.killpg(pid, signal.SIGKILL)


def _sigkill_group(pid: int) -> None:
    os.killpg(pid, signal.SIGKILL)


def _left_of(run: ServeRun) -> list[str]:
    """What still runs of `run`: its Ray instance's processes (named by its temp root), Serve's orphaned
    HAProxies, anything listening on its HTTP port."""
    left = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if str(run.tmp) in command and process.pid != os.getpid():
            left.append(f"{process.pid}: {command[:160]}")
    left += [f"{p.pid}: orphaned {' '.join(p.cmdline())}" for p in leftovers.orphaned_haproxies()]
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", run.port))
        except OSError:
            left.append(f"port {run.port} held")
    return left


def test_a_serve_run_stopped_each_way_leaves_nothing_and_the_next_one_serves():
    """One run after the other, each stopped its way; each next run serves (HAProxy's own ports, which
    every run takes, given back); Ctrl+C stops every other `serve run` of the suite."""
    for stop in (_sigterm, _sigterm_group, _ctrl_c_then_sigkill, _sigkill_group, None):
        run = ServeRun(ARGS).start()
        try:
            assert httpx.post(run.base_url + "/v1/chat/completions", timeout=60, json={
                "model": "mmserve-builtin", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
            if stop is None:
                return
            stop(run.proc.pid)
            deadline = time.monotonic() + 60
            while (left := _left_of(run)) and time.monotonic() < deadline:
                time.sleep(1)
            assert not left, f"{stop.__name__} left, 60 s later:\n" + "\n".join(left)
        finally:
            run.stop()
