"""LLaVA-1.5 image chats through the Serve graph against a real vLLM 0.32 CPU engine: identical
prompt token ids (576 `<image>` tokens per image, no BOS on the chat path) and identical greedy
tokens and text to vLLM's offline `LLM.chat` for the same messages.

Images cover the CLIP preprocessing cases: landscape needing resize and a horizontal crop
(500x400), exactly 336x336 (identity), portrait needing resize and a vertical crop (200x600),
and a small one needing an upscale (150x120). LLaVA engines expect host-normalised pixels.
"""

from __future__ import annotations


import pytest

from tests.conftest import deploy_app
from tests.support.images import image_part, image_uri
from tests.support.session_vllm import OfflineReference

pytestmark = [pytest.mark.real_engine, pytest.mark.serve]

APP_NAME = "vllm-llava"
MODEL_NAME = "tiny-llava"
MAX_MODEL_LEN = 2048  # two images already take 1152 tokens
IMAGE_TOKENS = 576




IMG_LANDSCAPE = image_uri(500, 400, 11)  # resize to 420x336, crop columns
IMG_IDENTITY = image_uri(336, 336, 12)  # no resize, no crop
IMG_PORTRAIT = image_uri(200, 600, 13, "JPEG")  # resize to 336x1008, crop rows
IMG_SMALL = image_uri(150, 120, 14)  # upscale, then crop

CHATS = [
    # 0: one image, then text.
    [{"role": "user", "content": [image_part(IMG_LANDSCAPE), {"type": "text", "text": "What is in this image?"}]}],
    # 1: two images in one message, interleaved with text (the template puts images first).
    [{"role": "user", "content": [
        {"type": "text", "text": "Compare the first"}, image_part(IMG_IDENTITY),
        {"type": "text", "text": "with the second"}, image_part(IMG_PORTRAIT), {"type": "text", "text": "briefly."}]}],
    # 2: two images in different turns: far apart in the prompt.
    [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, image_part(IMG_PORTRAIT)]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [image_part(IMG_SMALL), {"type": "text", "text": "And this one?"}]},
    ],
    # 3: system message (the template drops its role prefix) and an image-only user turn.
    [{"role": "system", "content": "Describe images."}, {"role": "user", "content": [image_part(IMG_IDENTITY)]}],
    # 4: same text as 0 with a different image: the answer must depend on the pixels.
    [{"role": "user", "content": [image_part(IMG_SMALL), {"type": "text", "text": "What is in this image?"}]}],
]
NUM_IMAGES = [1, 2, 2, 1, 1]
GREEDY = {"temperature": 0.0, "max_tokens": 16}


# The offline reference must compute with the engine's thread count. A `vllm serve` engine on this
# 2-core machine binds ONE OpenMP thread (VLLM_CPU_OMP_THREADS_BIND=auto reserves a CPU), while the
# in-process offline `LLM` runs torch on 2 threads; bf16 GEMMs then round differently and greedy LLaVA
# outputs diverge after a few tokens (vLLM's own API server gives exactly the gateway's tokens). Every
# vLLM process of the tests gets OMP_NUM_THREADS=1 (vllm_reference.VLLM_CPU_ENV). The reference cache
# key ignores the environment, so each case also carries it (the reference child ignores unknown case keys).
REFERENCE_ENV = {"OMP_NUM_THREADS": "1"}
# One OpenMP thread in the engine on any machine (what "auto" binding gives on 2 cores).
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
REFERENCE = OfflineReference(
    MODEL_NAME, [{"messages": chat, "sampling": GREEDY, "env": REFERENCE_ENV} for chat in CHATS],
    {"max_model_len": MAX_MODEL_LEN},
)
OFFLINE_REFERENCES = [REFERENCE]  # computed in the background after collection


@pytest.fixture(scope="module")
def llava_app(serve_instance, tiny_llava_dir):
    from ray import serve

    from tests.support.vllm_engines import HeadlessVllmEngine, free_tcp_port

    port = free_tcp_port()
    engine = HeadlessVllmEngine(tiny_llava_dir, port, max_model_len=MAX_MODEL_LEN, env=ENGINE_ENV).start()
    try:
        try:
            app = deploy_app(
                serve_instance, APP_NAME,
                {"model": str(tiny_llava_dir), "served_model_name": MODEL_NAME,
                 "engines": [f"tcp://127.0.0.1:{port}"], "images": {"pixel_mode": "host_normalize"},
                 "handshake_timeout_s": 600, "health_check_timeout_s": 20},
                ready_timeout_s=600,
            )
        except BaseException:
            print(engine.log_tail())
            raise
        yield app
    finally:
        engine.stop()
        serve.delete(APP_NAME, _blocking=True)


@pytest.fixture(scope="module")
def llava_refs(session_vllm):
    return session_vllm.offline_reference(REFERENCE)


def test_reference_prompts_have_expected_shape(llava_refs):
    from tests.support.tiny_models import LLAVA_IMAGE_TOKEN_ID

    for ref, n in zip(llava_refs, NUM_IMAGES):
        ids = ref.prompt_token_ids
        assert ids.count(LLAVA_IMAGE_TOKEN_ID) == IMAGE_TOKENS * n
        assert ids[0] != 1, "vLLM's chat path adds no BOS for llava-hf templates"
    # The tiny model must actually look at the pixels: same text, different image, different answer.
    assert llava_refs[0].outputs[0].token_ids != llava_refs[4].outputs[0].token_ids


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_llava_chat_equals_vllm_offline(llava_app, llava_refs, index):
    ref = llava_refs[index]
    client = llava_app.openai(timeout=300)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=CHATS[index], extra_body={"return_token_ids": True}, **GREEDY
    )
    assert r.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    (choice,) = r.choices
    (want,) = ref.outputs
    assert (choice.model_extra["token_ids"], choice.message.content, choice.finish_reason) == (
        want.token_ids, want.text, want.finish_reason
    )


def test_llava_streamed_chat_equals_vllm_offline(llava_app, llava_refs):
    ref = llava_refs[2]
    client = llava_app.openai(timeout=300)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHATS[2], extra_body={"return_token_ids": True}, stream=True, **GREEDY
    )
    prompt_ids, token_ids, text, finish = None, [], "", None
    for chunk in stream:
        prompt_ids = chunk.model_extra.get("prompt_token_ids") or prompt_ids
        for c in chunk.choices:
            token_ids += c.model_extra.get("token_ids") or []
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert prompt_ids == ref.prompt_token_ids
    assert (token_ids, text, finish) == (ref.outputs[0].token_ids, ref.outputs[0].text, ref.outputs[0].finish_reason)

