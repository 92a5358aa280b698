"""A dying engine ends every open stream with an error quickly, and the service recovers.

Each test gets its own application (and, for vLLM, its own engine) so that killing an engine
never disturbs the other tests.
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from tests.conftest import TINY_MODEL_NAME, deploy_app
from tests.e2e.fault_support import (
    FAULT_ENGINE_MAX_MODEL_LEN,
    VLLM_LONG_STREAM_TOKENS,
    assert_all_failed_fast,
    open_streams,
    open_streams_running_in_engine,
)

pytestmark = pytest.mark.serve

def test_builtin_engine_killed_mid_stream(serve_instance):
    app = deploy_app(serve_instance, "faults-builtin", {"builtin_engine": {"step_interval_ms": 5.0}})
    pid = app.engine_info().builtin_pid
    assert pid
    threads, results = open_streams(app, "mmserve-builtin", 3)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert_all_failed_fast(threads, results, killed_at)
    # Serve replaces the failed engine client, which starts a fresh built-in engine.
    deadline = time.monotonic() + 90
    while True:
        try:
            r = app.openai(timeout=30).chat.completions.create(
                model="mmserve-builtin", messages=[{"role": "user", "content": "still there?"}], max_tokens=4)
            assert r.choices[0].finish_reason in ("stop", "length")
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "service did not recover after the engine died"
            time.sleep(1)
    assert app.engine_info().builtin_pid != pid
    from ray import serve

    serve.delete("faults-builtin", _blocking=True)


@pytest.mark.real_engine
def test_vllm_engine_killed_mid_stream(serve_instance, tiny_qwen2_vl_dir):
    from tests.support.vllm_engines import HeadlessVllmEngine, free_tcp_port

    port = free_tcp_port()
    engine = HeadlessVllmEngine(tiny_qwen2_vl_dir, port, max_model_len=FAULT_ENGINE_MAX_MODEL_LEN).start()
    try:
        app = deploy_app(
            serve_instance, "faults-vllm",
            {"model": str(tiny_qwen2_vl_dir), "served_model_name": TINY_MODEL_NAME,
             "engines": [f"tcp://127.0.0.1:{port}"], "health_check_timeout_s": 20},
            ready_timeout_s=600,
        )
        # Warm the engine up first, so both streams are long past their first token, and far from
        # their last, when the engine dies.
        app.openai(timeout=120).chat.completions.create(
            model=TINY_MODEL_NAME, messages=[{"role": "user", "content": "warm up"}], max_tokens=8)
        threads, results = open_streams_running_in_engine(app, TINY_MODEL_NAME, 2, VLLM_LONG_STREAM_TOKENS)
        killed_at = time.monotonic()
        engine.kill()
        assert_all_failed_fast(threads, results, killed_at)
        # New requests fail fast with 503 instead of hanging while no engine is there.
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            app.openai(timeout=60).chat.completions.create(
                model=TINY_MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert err.value.status_code == 503
        assert time.monotonic() - t0 < 45
    finally:
        engine.stop()
        from ray import serve

        serve.delete("faults-vllm", _blocking=True)
