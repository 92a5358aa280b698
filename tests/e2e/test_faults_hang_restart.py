"""A hung engine (SIGSTOP) fails its streams fast; engines restarted on the same addresses
are picked up again without any manual step; nothing is left in flight after a fault.

Each test has its own application (and its own engines); the health check is made tight
(`health_check_interval_s` 0.5, `health_check_timeout_s` 1.0), so a hang is declared within
1.5 s and every open stream must end with an error within 2 s. A real vLLM engine gets 2.0 s to answer
(streams must end within 3 s): on 2 cores its first steps after start-up can take over a second, and
an engine busy with a step answers no health check (it was twice declared hung before the fault at 1.0 s).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
from ray import serve

from tests.conftest import TINY_MODEL_NAME, deploy_app
from tests.e2e.fault_support import (
    FAULT_ENGINE_MAX_MODEL_LEN,
    VLLM_LONG_STREAM_TOKENS,
    assert_all_failed_fast,
    open_streams,
    open_streams_running_in_engine,
    wait_for,
)

pytestmark = pytest.mark.serve

FAST_HEALTH = {"health_check_interval_s": 0.5, "health_check_timeout_s": 1.0}
VLLM_FAST_HEALTH = {"health_check_interval_s": 0.5, "health_check_timeout_s": 2.0}
BUILTIN = "mmserve-builtin"


# ----------------------------------------------------------------------------- helpers




def _chat(app, model: str, content: str = "still there?", max_tokens: int = 4):
    return app.openai(timeout=60).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens)


def _wait_recovered(app, model: str, timeout_s: float) -> float:
    start = time.monotonic()

    def ok() -> bool:
        try:
            return _chat(app, model).choices[0].finish_reason in ("stop", "length")
        except openai.APIError:
            return False

    wait_for(ok, timeout_s, "service recovered", interval_s=0.5)
    return time.monotonic() - start


def _assert_nothing_in_flight(app, index: int = 0, within_s: float = 1.0) -> None:
    """Engine-side running requests back to 0 and the engine client's in-flight map empty."""
    wait_for(lambda: app.engine_utility("has_work", index=index) is False, within_s, "engine idle")
    info = app.engine_info(index)
    assert info.state == "ready", info
    assert info.num_in_flight == 0, info


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _health(app) -> httpx.Response:
    return httpx.get(app.base_url + "/health", timeout=10)


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
            assert_all_failed_fast(threads, results, stopped_at)
            for r in results:
                assert "health check" in r["message"], r
            # The replica reports the hang until the engine it starts in its place is ready.
            info = app.engine_info()
            assert info.state == "dead" and "health check" in (info.death_reason or ""), info
            assert info.num_in_flight == 0, info
            health = _health(app)
            assert health.status_code == 503, health.text
            entry = health.json()["engines"][0]
            assert entry["state"] in ("dead", "starting", "unreachable") and entry["state"] != "ready", entry
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed by its engine client already
                os.kill(pid, signal.SIGCONT)
        took = _wait_recovered(app, BUILTIN, 90)
        info = app.engine_info()
        assert info.builtin_pid != pid and info.state == "ready", info
        _assert_nothing_in_flight(app)
        # The hung engine does not outlive the replica that gave up on it.
        wait_for(lambda: _pid_gone(pid), 30, f"old built-in engine {pid} gone")
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
        health = _health(app)
        assert health.status_code == 503 and "connection lost" in health.text, health.text
        _wait_recovered(app, BUILTIN, 90)
        info = app.engine_info()
        assert info.builtin_pid not in (None, pid) and info.state == "ready", info
        _assert_nothing_in_flight(app)
        assert _health(app).status_code == 200
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
            r = _chat(app, BUILTIN, f"request {i}")
            assert r.choices[0].finish_reason in ("stop", "length")
        for t in threads:
            t.join(timeout=30)
        outcomes = sorted(r["outcome"] for r in results)
        assert outcomes == ["completed", "error"], results
        failed = next(r for r in results if r["outcome"] == "error")
        assert failed["ended_at"] - killed_at <= 2.0, failed
        # /health: still serving (200), naming the dead engine and why.
        health = _health(app)
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
        wait_for(lambda: _health(app).json()["engines"][0]["state"] == "ready", 30, "the ingress sees engine 0 ready")
        sent_before = app.engine_info(0).requests_sent
        for i in range(6):
            _chat(app, BUILTIN, f"after restart {i}")
        assert app.engine_info(0).requests_sent > sent_before, "restarted engine gets no traffic"
        for i in (0, 1):
            _assert_nothing_in_flight(app, i)
        assert _health(app).status_code == 200
    finally:
        for p in procs:
            _stop(p)
        serve.delete(name, _blocking=True)


# ----------------------------------------------------------------------------- real vLLM


@pytest.mark.real_engine
def test_vllm_sigstopped_mid_stream_then_new_engine_on_same_port(serve_instance, tiny_qwen2_vl_dir):
    """Real engine hung → streams end with an error within 3 s (VLLM_FAST_HEALTH) → the hung engine is killed and
    a NEW `vllm serve --headless` is started on the same handshake port → requests succeed
    again with no manual step (Serve replaced the engine client, which re-handshakes)."""
    from tests.support.vllm_engines import HeadlessVllmEngine, free_tcp_port

    name = "hang-vllm"
    port = free_tcp_port()
    engines = [HeadlessVllmEngine(tiny_qwen2_vl_dir, port, max_model_len=FAULT_ENGINE_MAX_MODEL_LEN).start()]
    try:
        app = deploy_app(
            serve_instance, name,
            {"model": str(tiny_qwen2_vl_dir), "served_model_name": TINY_MODEL_NAME,
             "engines": [f"tcp://127.0.0.1:{port}"], **VLLM_FAST_HEALTH},
            ready_timeout_s=600,
        )
        threads, results = open_streams_running_in_engine(app, TINY_MODEL_NAME, 2, VLLM_LONG_STREAM_TOKENS)
        stopped_at = time.monotonic()
        engines[0].sigstop()
        assert_all_failed_fast(threads, results, stopped_at, limit_s=3.0)
        info = app.engine_info()
        assert info.state == "dead" and "health check" in (info.death_reason or ""), info
        assert info.num_in_flight == 0
        assert _health(app).status_code == 503
        # Replace the hung engine with a new one on the same port.
        engines[0].kill()
        engines.append(HeadlessVllmEngine(tiny_qwen2_vl_dir, port, max_model_len=FAULT_ENGINE_MAX_MODEL_LEN).start())
        try:
            _wait_recovered(app, TINY_MODEL_NAME, 300)
        except AssertionError:
            print(engines[-1].log_tail())
            raise
        r = _chat(app, TINY_MODEL_NAME, "hello", max_tokens=8)
        assert r.usage.completion_tokens > 0
        _assert_nothing_in_flight(app)
        assert _health(app).status_code == 200
    finally:
        for engine in engines:
            engine.stop()
        serve.delete(name, _blocking=True)
