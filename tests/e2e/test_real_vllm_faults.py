"""A real vLLM 0.32 CPU engine behind the Serve graph: images it holds are not sent again, and when
it hangs, is replaced or dies, every open stream ends with an error fast and the service recovers.

The tests share one application and one handshake port; each takes the engine as the last one left
it and starts a new `vllm serve --headless` on that port when it is gone (`FaultEngineApp.serving`),
so each also runs alone. One engine serves both the skip-resend and the hang test; the hang test's
replacement engine is the one the kill test kills: three vLLM start-ups at most, not five.

Skip-resend, proven by the bytes the engine client puts on the wire: the second request with the
same image sends no pixel frames and gets the same greedy tokens; an engine that lost its cached
items (vLLM's `reset_mm_cache` utility) answers with `mm_cache_miss_hashes`, the engine client
resends once with the data and the client sees a normal answer with the same tokens; a restarted
engine starts with an empty cache and so does the mirror: the first request after the restart sends
the pixels again (no miss, no resend).

The health check is tight (VLLM_FAST_HEALTH: every 0.5 s, 3.0 s to answer), so a hang is declared
within 3.5 s and open streams must end within 4 s. 3.0 s, not the built-in engine's 1.0 s: an engine
busy with a step answers no health check, and on 2 cores shared with Serve and the tests a real
engine's steps sometimes take seconds (it was declared hung before the fault twice at 1.0 s, and once
at 2.0 s while running two long streams; outputs read, or waiting unread behind a stalled gateway, now
also prove it alive: mmserve/engine/liveness.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from ray import serve

from tests.conftest import TINY_MODEL_NAME, DeployedApp, deploy_app
from tests.e2e.fault_support import (
    FAULT_ENGINE_MAX_MODEL_LEN,
    VLLM_LONG_STREAM_TOKENS,
    assert_all_failed_fast,
    assert_nothing_in_flight,
    get_health,
    open_streams_running_in_engine,
    short_chat,
    wait_for,
    wait_recovered,
)
from tests.support.images import image_part, image_uri
from tests.support.vllm_engines import HeadlessVllmEngine, free_tcp_port

# Tight time bounds: not while the work started after collection shares the cores.
pytestmark = [pytest.mark.real_engine, pytest.mark.serve, pytest.mark.usefixtures("background_settled")]

APP_NAME = "vllm-faults"
VLLM_FAST_HEALTH = {"health_check_interval_s": 0.5, "health_check_timeout_s": 3.0}
IMAGE = image_uri(300, 200, 21)  # resized to 308×196: 22×14 patches of 1176 uint8 = 362 208 bytes
PIXEL_BYTES = 22 * 14 * 1176
# An ADD without its pixels: msgpack body with ≈100 prompt token ids and the sampling params.
MAX_ADD_WITHOUT_PIXELS = 4096


@dataclass
class FaultEngineApp:
    app: DeployedApp
    model_dir: Path
    port: int
    engines: list[HeadlessVllmEngine] = field(default_factory=list)

    @property
    def engine(self) -> HeadlessVllmEngine:
        return self.engines[-1]

    def start_engine(self) -> HeadlessVllmEngine:
        self.engines.append(HeadlessVllmEngine(self.model_dir, self.port, max_model_len=FAULT_ENGINE_MAX_MODEL_LEN).start())
        return self.engine

    def serving(self) -> DeployedApp:
        """The app with a live engine: the last one, or a new one if a test left it dead or hung."""
        if not self.engine.is_alive() or _engine_state(self.app) not in ("ready", None):
            self.engine.kill()
            self.start_engine()
        try:
            wait_for(lambda: _engine_state(self.app) == "ready", 600, "engine ready", interval_s=1.0)
            wait_recovered(self.app, TINY_MODEL_NAME, 120)  # also warms a fresh engine up
        except AssertionError:
            print(self.engine.log_tail())
            raise
        return self.app


def _engine_state(app) -> str | None:
    try:
        return app.engine_info().state
    except Exception:  # noqa: BLE001 - the replica is being replaced
        return None


@pytest.fixture(scope="module")
def fault_app(serve_instance, tiny_qwen2_vl_dir):
    port = free_tcp_port()
    engine = HeadlessVllmEngine(tiny_qwen2_vl_dir, port, max_model_len=FAULT_ENGINE_MAX_MODEL_LEN).start()
    faults = None
    try:
        app = deploy_app(
            serve_instance, APP_NAME,
            {"model": str(tiny_qwen2_vl_dir), "served_model_name": TINY_MODEL_NAME,
             "engines": [engine.handshake_address], "handshake_timeout_s": 600, **VLLM_FAST_HEALTH},
            ready_timeout_s=600,
        )  # fmt: skip
        faults = FaultEngineApp(app, tiny_qwen2_vl_dir, port, [engine])
        yield faults
    except BaseException:
        print(engine.log_tail() if faults is None else faults.engine.log_tail())
        raise
    finally:
        for e in faults.engines if faults else [engine]:
            e.stop()
        serve.delete(APP_NAME, _blocking=True)


def _ask_about_the_image(app) -> list[int]:
    r = app.openai(timeout=180).chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=[{"role": "user", "content": [image_part(IMAGE), {"type": "text", "text": "What is this?"}]}],
        temperature=0.0, max_tokens=12, extra_body={"return_token_ids": True},
    )  # fmt: skip
    return r.choices[0].model_extra["token_ids"]


def _sent(app) -> tuple[list[int], int]:
    """The image request's greedy tokens and the bytes the engine client sent for it."""
    before = app.engine_info().bytes_sent
    tokens = _ask_about_the_image(app)
    return tokens, app.engine_info().bytes_sent - before


def _skips_and_resends(app) -> tuple[int, int]:
    info = app.engine_info()
    return info.mm_items_skipped, info.mm_cache_miss_resends


def test_repeated_image_sent_by_hash_and_a_miss_resent(fault_app):
    app = fault_app.serving()
    app.engine_utility("reset_mm_cache")  # whatever an earlier test sent: the engine holds nothing
    first, first_bytes = _sent(app)  # the mirror may still believe it holds the image: a miss, resent
    skips, resends = _skips_and_resends(app)
    recalled = app.engine_info().images_recalled
    second, second_bytes = _sent(app)
    print(f"bytes sent: first {first_bytes}, repeat {second_bytes}")
    assert first_bytes >= PIXEL_BYTES, first_bytes
    assert second_bytes < MAX_ADD_WITHOUT_PIXELS, second_bytes
    assert second == first and len(first) > 0
    assert _skips_and_resends(app) == (skips + 1, resends)

    # Forced drift: the engine drops its cached items; the mirror still believes it holds them.
    app.engine_utility("reset_mm_cache")
    third, third_bytes = _sent(app)
    assert third == first
    assert _skips_and_resends(app) == (skips + 2, resends + 1)
    # One ADD by hash (missed), one resend with the pixels: the repeats were recalled without the
    # preprocessor (`RecentImages`), so the third's pixels were processed anew for its resend.
    assert PIXEL_BYTES <= third_bytes < PIXEL_BYTES + 2 * MAX_ADD_WITHOUT_PIXELS, third_bytes
    assert app.engine_info().images_recalled - recalled == 2
    fourth, fourth_bytes = _sent(app)
    assert fourth == first and fourth_bytes < MAX_ADD_WITHOUT_PIXELS


def test_hung_engine_fails_streams_fast_and_a_new_engine_on_its_port_serves_with_an_empty_cache(fault_app):
    """Engine hung (SIGSTOP) → streams end with an error within 4 s → the hung engine is killed and a
    NEW `vllm serve --headless` is started on the same handshake port → requests succeed again with
    no manual step (Serve replaced the engine client, which re-handshakes), and the image the old
    engine held is sent again, pixels and all."""
    app = fault_app.serving()
    tokens, _ = _sent(app)  # the old engine (and the mirror) now hold the image
    _, repeat_bytes = _sent(app)
    assert repeat_bytes < MAX_ADD_WITHOUT_PIXELS

    threads, results = open_streams_running_in_engine(app, TINY_MODEL_NAME, 2, VLLM_LONG_STREAM_TOKENS)
    stopped_at = time.monotonic()
    fault_app.engine.sigstop()
    assert_all_failed_fast(threads, results, stopped_at, limit_s=4.0)
    info = app.engine_info()
    assert info.state == "dead" and "health check" in (info.death_reason or ""), info
    assert info.num_in_flight == 0
    assert get_health(app).status_code == 503

    fault_app.engine.kill()
    fault_app.start_engine()
    try:
        wait_recovered(app, TINY_MODEL_NAME, 300)
    except AssertionError:
        print(fault_app.engine.log_tail())
        raise
    r = short_chat(app, TINY_MODEL_NAME, "hello", max_tokens=8)
    assert r.usage.completion_tokens > 0
    assert_nothing_in_flight(app)
    assert get_health(app).status_code == 200

    # A new engine client with an empty mirror: the pixels go again, no miss, no resend.
    again, again_bytes = _sent(app)
    assert again == tokens
    assert again_bytes >= PIXEL_BYTES, again_bytes
    assert _skips_and_resends(app) == (0, 0)
    _, repeat_bytes = _sent(app)
    assert repeat_bytes < MAX_ADD_WITHOUT_PIXELS


def test_killed_engine_fails_streams_fast_and_new_requests_get_503(fault_app):
    app = fault_app.serving()
    threads, results = open_streams_running_in_engine(app, TINY_MODEL_NAME, 2, VLLM_LONG_STREAM_TOKENS)
    killed_at = time.monotonic()
    fault_app.engine.kill()
    assert_all_failed_fast(threads, results, killed_at)
    # New requests fail fast with 503 instead of hanging while no engine is there.
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        app.openai(timeout=60).chat.completions.create(
            model=TINY_MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert err.value.status_code == 503
    assert time.monotonic() - t0 < 45
