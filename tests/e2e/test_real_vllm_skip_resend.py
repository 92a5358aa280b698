"""Skip resending images a real vLLM 0.32 engine holds (its multimodal receiver cache, mirrored by the
engine client), proven by the bytes the engine client puts on the wire:

- the second request with the same image sends no pixel frames and gets the same greedy tokens;
- an engine that lost its cached items (vLLM's `reset_mm_cache` utility) answers with
  `mm_cache_miss_hashes`; the engine client resends once with the data and the client sees a
  normal answer with the same tokens;
- a restarted engine starts with an empty cache and so does the mirror: the first request after
  the restart sends the pixels again (no miss, no resend).
"""

from __future__ import annotations

import pytest
from ray import serve

from tests.conftest import TINY_MODEL_NAME, deploy_app
from tests.e2e.fault_support import wait_for
from tests.support.images import image_part, image_uri

pytestmark = [pytest.mark.real_engine, pytest.mark.serve]

IMAGE = image_uri(300, 200, 21)  # resized to 308×196: 22×14 patches of 1176 uint8 = 362 208 bytes
PIXEL_BYTES = 22 * 14 * 1176
# An ADD without its pixels: msgpack body with ≈100 prompt token ids and the sampling params.
MAX_ADD_WITHOUT_PIXELS = 4096


def _ask(app):
    r = app.openai(timeout=180).chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=[{"role": "user", "content": [image_part(IMAGE), {"type": "text", "text": "What is this?"}]}],
        temperature=0.0, max_tokens=12, extra_body={"return_token_ids": True},
    )
    return r.choices[0].model_extra["token_ids"]


def _sent(app, ask):
    before = app.engine_info().bytes_sent
    tokens = ask(app)
    return tokens, app.engine_info().bytes_sent - before


def test_repeated_image_sent_by_hash_miss_resent_restart_resets(serve_instance, tiny_qwen2_vl_dir):
    from tests.support.vllm_engines import HeadlessVllmEngine, free_tcp_port

    name = "skip-resend"
    port = free_tcp_port()
    engines = [HeadlessVllmEngine(tiny_qwen2_vl_dir, port, max_model_len=1024).start()]
    try:
        app = deploy_app(
            serve_instance, name,
            {"model": str(tiny_qwen2_vl_dir), "served_model_name": TINY_MODEL_NAME,
             "engines": [f"tcp://127.0.0.1:{port}"], "handshake_timeout_s": 600, "health_check_timeout_s": 20},
            ready_timeout_s=600,
        )
        first, first_bytes = _sent(app, _ask)
        second, second_bytes = _sent(app, _ask)
        info = app.engine_info()
        print(f"bytes sent: first {first_bytes}, repeat {second_bytes}")
        assert first_bytes >= PIXEL_BYTES, first_bytes
        assert second_bytes < MAX_ADD_WITHOUT_PIXELS, second_bytes
        assert second == first and len(first) > 0
        assert (info.mm_items_skipped, info.mm_cache_miss_resends) == (1, 0), info

        # Forced drift: the engine drops its cached items; the mirror still believes it holds them.
        app.engine_utility("reset_mm_cache")
        third, third_bytes = _sent(app, _ask)
        info = app.engine_info()
        assert third == first
        assert (info.mm_items_skipped, info.mm_cache_miss_resends) == (2, 1), info
        # One ADD by hash (missed), one resend with the pixels.
        assert PIXEL_BYTES <= third_bytes < PIXEL_BYTES + 2 * MAX_ADD_WITHOUT_PIXELS, third_bytes
        fourth, fourth_bytes = _sent(app, _ask)
        assert fourth == first and fourth_bytes < MAX_ADD_WITHOUT_PIXELS

        # Restart: kill the engine, start a new one on the same port; Serve replaces the engine
        # client, which handshakes with it and starts with an empty mirror.
        engines[0].kill()
        wait_for(lambda: not _engine_ready(app), 30, "engine client noticed the kill")
        engines.append(HeadlessVllmEngine(tiny_qwen2_vl_dir, port, max_model_len=1024).start())
        wait_for(lambda: _engine_ready(app), 600, "restarted engine ready", interval_s=1.0)
        fifth, fifth_bytes = _sent(app, _ask)
        info = app.engine_info()
        assert fifth == first
        assert fifth_bytes >= PIXEL_BYTES, fifth_bytes
        assert (info.mm_items_skipped, info.mm_cache_miss_resends) == (0, 0), info
        sixth, sixth_bytes = _sent(app, _ask)
        assert sixth == first and sixth_bytes < MAX_ADD_WITHOUT_PIXELS
    except BaseException:
        print(engines[-1].log_tail())
        raise
    finally:
        for engine in engines:
            engine.stop()
        serve.delete(name, _blocking=True)


def _engine_ready(app) -> bool:
    try:
        return app.engine_info().state == "ready"
    except Exception:
        return False
