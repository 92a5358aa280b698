"""Qwen2.5-VL and Qwen3-VL image chats through the Serve graph against real vLLM 0.32 CPU engines
running tiny random-weight models built by the test (Qwen2.5-VL: windowed vision attention; Qwen3-VL:
16x16 patches, factor 32, mean/std 0.5, deepstack): identical prompt token ids and greedy tokens to
vLLM's offline `LLM.chat`, in both pixel modes these families support (uint8 patches normalised on
the device, vLLM's default; host-normalised bf16 with `--no-mm-device-do-normalize`). Qwen2-VL's own
test is test_real_vllm_images.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import deploy_app
from tests.e2e.test_real_vllm_images import CHATS, GREEDY, IMG_TINY
from tests.support.images import image_part
from tests.support.session_vllm import OfflineReference

pytestmark = [pytest.mark.real_engine, pytest.mark.serve]

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# CHATS[0]'s text with another image: the answer must depend on the pixels.
OTHER_IMAGE = [{"role": "user", "content": [image_part(IMG_TINY), {"type": "text", "text": "What is in this image?"}]}]


def _serve(serve_instance, engine, model_name: str, app_name: str, pixel_mode: str):
    try:
        return deploy_app(
            serve_instance, app_name,
            {"model": str(engine.model_dir), "served_model_name": model_name, "engines": [engine.handshake_address],
             "images": {"pixel_mode": pixel_mode}, "handshake_timeout_s": 600, "health_check_timeout_s": 20},
            ready_timeout_s=600,
        )  # fmt: skip
    except BaseException:
        print(engine.log_tail())
        raise


def _assert_same(app, model_name: str, refs, cases) -> None:
    client = app.openai(timeout=300)
    for case, ref in zip(cases, refs):
        r = client.chat.completions.create(
            model=model_name, messages=case["messages"], extra_body={"return_token_ids": True}, **case["sampling"]
        )
        assert r.model_extra["prompt_token_ids"] == ref.prompt_token_ids
        got = sorted((c.model_extra["token_ids"], c.message.content, c.finish_reason) for c in r.choices)
        want = sorted((o.token_ids, o.text, o.finish_reason) for o in ref.outputs)
        assert got == want


CASES = [{"messages": chat, "sampling": GREEDY} for chat in [*CHATS, OTHER_IMAGE]]
CASES.append({"messages": CHATS[0], "sampling": {"temperature": 0.8, "seed": 11, "n": 2, "max_tokens": 12}})
PIXEL_MODES = {  # pixel mode: (engine flags, the offline reference's engine arguments)
    "device_normalize": ([], {}),
    "host_normalize": (["--no-mm-device-do-normalize"], {"mm_device_do_normalize": False}),
}
# Computed in the background after collection (tests/support/session_vllm.py).
REFERENCES = {
    (family, mode): OfflineReference(f"tiny-{family}", CASES, {"extra_engine_args": reference_args})
    for family in FAMILIES for mode, (_, reference_args) in PIXEL_MODES.items()
}
OFFLINE_REFERENCES = list(REFERENCES.values())


@pytest.fixture(scope="module")
def engines(tiny_qwen2_5_vl_dir, tiny_qwen3_vl_dir):
    """A headless engine per family and pixel mode, all four started at once: their start-ups are
    mostly imports, which then share the two cores instead of following one another (≈ 1 minute in all
    instead of four half-minutes). Each waits up to 5 minutes for its app's handshake; the four tests
    take well under that."""
    from tests.support.vllm_engines import HeadlessVllmEngine, free_tcp_port

    dirs = {"qwen2_5_vl": tiny_qwen2_5_vl_dir, "qwen3_vl": tiny_qwen3_vl_dir}
    started = {}
    try:
        for family in FAMILIES:
            for mode, (engine_args, _) in PIXEL_MODES.items():
                started[family, mode] = HeadlessVllmEngine(
                    dirs[family], free_tcp_port(), max_model_len=1024, extra_args=engine_args
                ).start()
        yield started
    finally:
        for engine in started.values():
            engine.stop()


@pytest.mark.parametrize("pixel_mode", PIXEL_MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_images_equal_vllm_offline(serve_instance, session_vllm, engines, family, pixel_mode):
    from ray import serve

    model_name = f"tiny-{family}"
    engine = engines[family, pixel_mode]
    app_name = f"vllm-{family}-{pixel_mode}".replace("_", "-")
    try:
        app = _serve(serve_instance, engine, model_name, app_name, pixel_mode)
        refs = session_vllm.offline_reference(REFERENCES[family, pixel_mode])
        assert refs[0].outputs[0].token_ids != refs[len(CHATS)].outputs[0].token_ids
        _assert_same(app, model_name, refs, CASES)
    finally:
        engine.stop()
        serve.delete(app_name, _blocking=True)
