"""Image chats through the Serve graph against real vLLM 0.32 CPU engines: identical greedy tokens
for the same messages, in both pixel modes, with images that need resizing (down, up, one axis) and
images that do not. The reference is `vllm serve` itself for vLLM's default pixel mode (uint8
patches normalised on the device), vLLM's offline `LLM.chat` with `mm_device_do_normalize=False`
for host-normalised pixels.
"""

from __future__ import annotations

import pytest

from tests.conftest import TINY_MODEL_NAME, deploy_app
from tests.support.images import image_part, image_uri
from tests.support.session_vllm import OfflineReference

pytestmark = [pytest.mark.real_engine, pytest.mark.serve]




IMG_RESIZE = image_uri(300, 200, 1)  # downscale to multiples of 28
IMG_IDENTITY = image_uri(84, 56, 2)  # multiples of 28, within bounds: no resize
IMG_LARGE = image_uri(640, 480, 3, "JPEG")  # above max_pixels: downscale
IMG_TINY = image_uri(30, 20, 4)  # below min_pixels: upscale
IMG_ONE_AXIS = image_uri(112, 90, 5)  # width already a multiple of 28, height not

CHATS = [
    [{"role": "user", "content": [image_part(IMG_RESIZE), {"type": "text", "text": "What is in this image?"}]}],
    [{"role": "user", "content": [
        {"type": "text", "text": "Compare the first"}, image_part(IMG_IDENTITY),
        {"type": "text", "text": "with the second"}, image_part(IMG_LARGE), {"type": "text", "text": "briefly."}]}],
    [{"role": "system", "content": "Describe images."}, {"role": "user", "content": [image_part(IMG_TINY)]}],
    [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, image_part(IMG_ONE_AXIS)]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "Say more."},
    ],
]
GREEDY = {"temperature": 0.0, "max_tokens": 16}


def _ours(app, messages, **sampling):
    client = app.openai(timeout=180)
    return client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=messages, extra_body={"return_token_ids": True}, **sampling
    )


def _assert_same(app, refs, cases):
    for case, ref in zip(cases, refs):
        sampling = dict(case["sampling"])
        r = _ours(app, case["messages"], **sampling)
        assert r.model_extra["prompt_token_ids"] == ref.prompt_token_ids
        got = sorted((c.model_extra["token_ids"], c.message.content, c.finish_reason) for c in r.choices)
        want = sorted((o.token_ids, o.text, o.finish_reason) for o in ref.outputs)
        assert got == want


def test_device_normalize_images_equal_vllm_serve(vllm_app, vllm_serve_reference):
    cases = [{"messages": chat, "sampling": GREEDY} for chat in CHATS]
    cases.append({"messages": CHATS[0], "sampling": {"temperature": 0.8, "seed": 11, "n": 2, "max_tokens": 12}})
    refs = vllm_serve_reference.answers(cases)
    # The tiny model must actually look at the pixels: different images, different answers.
    assert refs[0].outputs[0].token_ids != refs[2].outputs[0].token_ids
    _assert_same(vllm_app.app, refs, cases)


HOST_NORMALIZE_CASES = [{"messages": chat, "sampling": GREEDY} for chat in CHATS[:3]]
HOST_NORMALIZE_REFERENCE = OfflineReference(
    TINY_MODEL_NAME, HOST_NORMALIZE_CASES, {"extra_engine_args": {"mm_device_do_normalize": False}}
)
OFFLINE_REFERENCES = [HOST_NORMALIZE_REFERENCE]  # computed in the background after collection


@pytest.fixture(scope="module")
def host_normalize_app(serve_instance, tiny_qwen2_vl_dir):
    from tests.support.vllm_engines import HeadlessVllmEngine, free_tcp_port

    port = free_tcp_port()
    engine = HeadlessVllmEngine(tiny_qwen2_vl_dir, port, max_model_len=1024, extra_args=["--no-mm-device-do-normalize"]).start()
    try:
        app = deploy_app(
            serve_instance, "vllm-host-norm",
            {"model": str(tiny_qwen2_vl_dir), "served_model_name": TINY_MODEL_NAME,
             "engines": [f"tcp://127.0.0.1:{port}"], "images": {"pixel_mode": "host_normalize"},
             "health_check_timeout_s": 20},
            ready_timeout_s=600,
        )
        yield app
    finally:
        engine.stop()
        from ray import serve

        serve.delete("vllm-host-norm", _blocking=True)


def test_host_normalize_images_equal_vllm_offline(host_normalize_app, session_vllm):
    _assert_same(host_normalize_app, session_vllm.offline_reference(HOST_NORMALIZE_REFERENCE), HOST_NORMALIZE_CASES)
