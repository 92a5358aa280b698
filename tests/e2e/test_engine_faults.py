"""A dying built-in engine ends every open stream with an error quickly, and the service recovers.

The test gets its own application so that killing its engine never disturbs the other tests. The
real vLLM engine's faults are in test_real_vllm_faults.py.
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from tests.conftest import deploy_app
from tests.e2e.fault_support import assert_all_failed_fast, open_streams

# Tight time bounds: not while the work started after collection shares the cores.
pytestmark = [pytest.mark.serve, pytest.mark.usefixtures("background_settled")]

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
