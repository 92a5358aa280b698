"""The whole Serve graph on the built-in engine, through the real `openai` client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.support.images import image_part, image_uri

pytestmark = pytest.mark.serve

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something about the sea."}]


def test_models_names_the_builtin_engine(builtin_app):
    models = builtin_app.openai().models.list()
    assert [m.id for m in models.data] == ["mmserve-builtin"]
    raw = httpx.get(builtin_app.base_url + "/v1/models").json()
    assert raw["data"][0]["engine"] == "mmserve-builtin"
    assert raw["data"][0]["max_model_len"] == 4096


def test_chat_non_streaming_is_deterministic(builtin_app):
    client = builtin_app.openai()
    first = client.chat.completions.create(model="mmserve-builtin", messages=CHAT, temperature=0, max_tokens=64)
    second = client.chat.completions.create(model="mmserve-builtin", messages=CHAT, temperature=0, max_tokens=64)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 0
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens


def test_streaming_equals_non_streaming(builtin_app):
    client = builtin_app.openai()
    full = client.chat.completions.create(model="mmserve-builtin", messages=CHAT, temperature=0, max_tokens=48,
                                          extra_body={"return_token_ids": True})
    stream = client.chat.completions.create(model="mmserve-builtin", messages=CHAT, temperature=0, max_tokens=48,
                                            stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert len(full.choices[0].token_ids) == full.usage.completion_tokens  # type: ignore[attr-defined]


def test_n2_and_seed(builtin_app):
    client = builtin_app.openai()
    resp = client.chat.completions.create(model="mmserve-builtin", messages=CHAT, n=2, temperature=0.8, seed=7, max_tokens=24)
    again = client.chat.completions.create(model="mmserve-builtin", messages=CHAT, n=2, temperature=0.8, seed=7, max_tokens=24)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.message.content for c in resp.choices] == [c.message.content for c in again.choices]
    # Children get seeds seed+0 and seed+1 (vLLM's parallel sampling), so they differ.
    assert resp.choices[0].message.content != resp.choices[1].message.content
    with_ids = client.chat.completions.create(model="mmserve-builtin", messages=CHAT, n=2, temperature=0.8, seed=7,
                                              max_tokens=24, extra_body={"return_token_ids": True})
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for c in with_ids.choices)  # type: ignore[attr-defined]


def test_stop_string_truncates_and_reports_reason(builtin_app):
    client = builtin_app.openai()
    base = client.chat.completions.create(model="mmserve-builtin", messages=CHAT, temperature=0, max_tokens=64)
    text = base.choices[0].message.content
    assert len(text) > 12
    stop = text[8:11]
    cut = text.index(stop)
    resp = client.chat.completions.create(model="mmserve-builtin", messages=CHAT, temperature=0, max_tokens=64, stop=[stop])
    assert resp.choices[0].message.content == text[:cut]
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["stop_reason"] == stop


def test_max_tokens_gives_length(builtin_app):
    resp = builtin_app.openai().chat.completions.create(
        model="mmserve-builtin", messages=CHAT, max_tokens=3, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3


def test_text_completions(builtin_app):
    client = builtin_app.openai()
    resp = client.completions.create(model="mmserve-builtin", prompt="Once upon a time", max_tokens=16, temperature=0)
    again = client.completions.create(model="mmserve-builtin", prompt="Once upon a time", max_tokens=16, temperature=0)
    assert resp.choices[0].text == again.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="mmserve-builtin", prompt="Once upon a time", max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == resp.choices[0].text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-17"}, "model"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "word " * 5000}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop"),
    ],
)
def test_bad_requests_get_openai_400(builtin_app, body, param):
    resp = httpx.post(builtin_app.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param


def test_invalid_json_gets_400(builtin_app):
    resp = httpx.post(builtin_app.base_url + "/v1/chat/completions", content=b'{"messages": [', timeout=30)
    assert resp.status_code == 400
    assert "JSON" in resp.json()["error"]["message"]


def test_openai_client_raises_bad_request(builtin_app):
    with pytest.raises(openai.BadRequestError):
        builtin_app.openai().chat.completions.create(model="mmserve-builtin", messages=CHAT, temperature=5)


def _wait_engine_idle(app, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if not app.engine_utility("has_work"):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"engine still has work {timeout_s} s after the client left")


def test_client_disconnect_mid_stream_aborts_engine_request(builtin_app):
    with httpx.stream(
        "POST", builtin_app.base_url + "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}, timeout=30,
    ) as resp:
        lines = resp.iter_lines()
        for _ in range(5):
            next(lines)
        assert builtin_app.engine_utility("has_work")
    # Leaving the block closed the connection mid-stream.
    assert _wait_engine_idle(builtin_app, 5.0) < 5.0
    assert builtin_app.engine_info().num_in_flight == 0


def test_text_and_image_requests_travel_over_the_link(builtin_app):
    """Every request goes to the engine client over ZMQ (`mmserve.transit.engine_link`): text requests, and
    image requests, whose images the engine client then has the preprocessor process; a request with
    images and `n` > 1 as one per choice, its choices sharing one preprocessing job, and one whose
    data URIs weigh megabytes."""
    client = builtin_app.openai()
    client.chat.completions.create(model="mmserve-builtin", messages=CHAT, max_tokens=4)  # the subscription is open
    before = builtin_app.engine_info()
    for stream in (False, True, False, True):
        response = client.chat.completions.create(model="mmserve-builtin", messages=CHAT, max_tokens=8, stream=stream)
        if stream:
            assert "".join(chunk.choices[0].delta.content or "" for chunk in response if chunk.choices)
        else:
            assert response.choices[0].message.content
    after_text = builtin_app.engine_info()
    image = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": image}}]}]
    for stream in (False, True):
        response = client.chat.completions.create(model="mmserve-builtin", max_tokens=4, messages=messages, stream=stream)
        if stream:
            assert [chunk for chunk in response if chunk.choices and chunk.choices[0].finish_reason]
        else:
            assert response.choices[0].message.content
    after_image = builtin_app.engine_info()
    new_image = [{"role": "user", "content": [{"type": "text", "text": "And this?"}, image_part(image_uri(64, 48, seed=11))]}]
    shared = client.chat.completions.create(model="mmserve-builtin", max_tokens=4, messages=new_image, n=2)
    assert len(shared.choices) == 2
    after_shared = builtin_app.engine_info()
    big = image_uri(900, 900, seed=3)  # noisy: a data URI of some MB
    assert len(big) > 2**20
    client.chat.completions.create(model="mmserve-builtin", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image_part(big)]}])
    after_big = builtin_app.engine_info()
    assert after_text.requests_sent - before.requests_sent == 4
    assert after_text.requests_received - before.requests_received == 4
    assert after_text.image_requests_received == before.image_requests_received
    assert after_image.requests_sent - after_text.requests_sent == 2
    assert after_image.requests_received - after_text.requests_received == 2
    assert after_image.image_requests_received - after_text.image_requests_received == 2
    assert after_shared.requests_sent - after_image.requests_sent == 2
    assert after_shared.image_requests_received - after_image.image_requests_received == 2
    assert after_shared.preprocessing_jobs - after_image.preprocessing_jobs == 1  # one image processed for both
    assert after_big.requests_sent - after_shared.requests_sent == 1
    assert after_big.image_requests_received - after_shared.image_requests_received == 1
