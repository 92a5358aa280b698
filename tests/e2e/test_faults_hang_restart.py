"""A hung built-in engine (SIGSTOP) fails its streams fast; engines restarted on the same addresses
are picked up again without any manual step; nothing is left in flight after a fault.

Each test has its own application (and its own engines); the health check is made tight
(`health_check_interval_s` 0.5, `health_check_timeout_s` 1.0), so a hang is declared within
1.5 s and every open stream must end with an error within 2 s of a kill, 2.5 s of a hang (its
detection takes up to 1.5 s of that; on 2 cores the error once needed 0.52 s more to reach the
client). The real vLLM engine's faults are in test_real_vllm_faults.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import httpx
import pytest
from ray import serve

from tests.conftest import deploy_app
from tests.e2e.fault_support import (
    assert_all_failed_fast,
    assert_nothing_in_flight,
    get_health,
    open_streams,
    short_chat,
    wait_for,
    wait_recovered,
)
from tests.support.processes import pid_gone

# Tight time bounds: not while the work started after collection shares the cores.
pytestmark = [pytest.mark.serve, pytest.mark.usefixtures("background_settled")]

FAST_HEALTH = {"health_check_interval_s": 0.5, "health_check_timeout_s": 1.0}
BUILTIN = "mmserve-builtin"


# ----------------------------------------------------------------------------- built-in engine


def test_builtin_engine_sigstopped_mid_stream_fails_fast_and_recovers(serve_instance):
    name = "hang-builtin"
    app = deploy_app(serve_instance, name, {"builtin_engine": {"step_interval_ms": 5.0}, **FAST_HEALTH})
    try:
        pid = app.engine_info().builtin_pid
        assert pid
        threads, results = open_streams(app, BUILTIN, 3)
        stopped_at = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            assert_all_failed_fast(threads, results, stopped_at, limit_s=2.5)
            for r in results:
                assert "health check" in r["message"], r
            # The replica reports the hang until the engine it starts in its place is ready.
            info = app.engine_info()
            assert info.state == "dead" and "health check" in (info.death_reason or ""), info
            assert info.num_in_flight == 0, info
            health = get_health(app)
            assert health.status_code == 503, health.text
            entry = health.json()["engines"][0]
            assert entry["state"] in ("dead", "starting", "unreachable") and entry["state"] != "ready", entry
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed by its engine client already
                os.kill(pid, signal.SIGCONT)
        took = wait_recovered(app, BUILTIN, 90)
        info = app.engine_info()
        assert info.builtin_pid != pid and info.state == "ready", info
        assert_nothing_in_flight(app)
        # The hung engine does not outlive the replica that gave up on it.
        wait_for(lambda: pid_gone(pid), 30, f"old built-in engine {pid} gone")
        print(f"recovered {took:.1f} s after the hang was detected")
    finally:
        serve.delete(name, _blocking=True)


def test_builtin_engine_killed_state_and_no_leaks(serve_instance):
    name = "kill-builtin"
    app = deploy_app(serve_instance, name, {"builtin_engine": {"step_interval_ms": 5.0}, **FAST_HEALTH})
    try:
        pid = app.engine_info().builtin_pid
        threads, results = open_streams(app, BUILTIN, 3)
        assert app.engine_info().num_in_flight == 3
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        assert_all_failed_fast(threads, results, killed_at, limit_s=1.0)
        info = app.engine_info()
        assert info.state == "dead" and "connection lost" in (info.death_reason or ""), info
        assert info.num_in_flight == 0, info
        health = get_health(app)
        assert health.status_code == 503 and "connection lost" in health.text, health.text
        wait_recovered(app, BUILTIN, 90)
        info = app.engine_info()
        assert info.builtin_pid not in (None, pid) and info.state == "ready", info
        assert_nothing_in_flight(app)
        assert get_health(app).status_code == 200
    finally:
        serve.delete(name, _blocking=True)


def _start_builtin(port: int) -> subprocess.Popen:
    from tests.support.defaults import builtin_engine_argv

    return subprocess.Popen(
        builtin_engine_argv(f"tcp://127.0.0.1:{port}", step_interval_ms=5.0),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_two_engines_one_killed_then_restarted_on_same_port(serve_instance):
    """Two external (built-in) engines: one dies, requests keep succeeding on the other, /health
    names the dead one, and a new engine started at once on the same port is picked up."""
    from tests.support.vllm_engines import free_tcp_port

    name = "two-engines"
    ports = [free_tcp_port(), free_tcp_port()]
    procs = [_start_builtin(p) for p in ports]
    try:
        app = deploy_app(serve_instance, name, {"engines": [f"tcp://127.0.0.1:{p}" for p in ports],
                                              "served_model_name": BUILTIN, **FAST_HEALTH})
        wait_for(lambda: all(app.engine_info(i).state == "ready" for i in (0, 1)), 60, "both engines ready")
        # One long stream on each engine (the router balances by requests in flight).
        threads, results = open_streams(app, BUILTIN, 2, max_tokens=400)
        assert [app.engine_info(i).num_in_flight for i in (0, 1)] == [1, 1]
        killed_at = time.monotonic()
        procs[0].kill()
        # Requests keep succeeding on the other engine, from the very first one after the kill.
        for i in range(10):
            r = short_chat(app, BUILTIN, f"request {i}")
            assert r.choices[0].finish_reason in ("stop", "length")
        for t in threads:
            t.join(timeout=30)
        outcomes = sorted(r["outcome"] for r in results)
        assert outcomes == ["completed", "error"], results
        failed = next(r for r in results if r["outcome"] == "error")
        assert failed["ended_at"] - killed_at <= 2.0, failed
        # /health: still serving (200), naming the dead engine and why.
        health = get_health(app)
        assert health.status_code == 200, health.text
        engines = health.json()["engines"]
        assert engines[1]["state"] == "ready", engines
        assert engines[0]["state"] != "ready", engines
        # /v1/models answers at once from the live engine.
        t0 = time.monotonic()
        models = httpx.get(app.base_url + "/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 4096, models.text
        assert time.monotonic() - t0 < 2.0
        # Restart engine 0 on the same handshake port right away (before Serve has replaced
        # the engine client that saw it die): the replacement must handshake with it.
        procs[0] = _start_builtin(ports[0])
        wait_for(lambda: app.engine_info(0).state == "ready", 90, "restarted engine 0 ready")
        # And the ingress has seen it (its view of the engines is refreshed each second).
        wait_for(lambda: get_health(app).json()["engines"][0]["state"] == "ready", 30, "the ingress sees engine 0 ready")
        sent_before = app.engine_info(0).requests_sent
        for i in range(6):
            short_chat(app, BUILTIN, f"after restart {i}")
        assert app.engine_info(0).requests_sent > sent_before, "restarted engine gets no traffic"
        for i in (0, 1):
            assert_nothing_in_flight(app, i)
        assert get_health(app).status_code == 200
    finally:
        for p in procs:
            _stop(p)
        serve.delete(name, _blocking=True)
