"""The Serve graph against a real vLLM 0.32 CPU engine: identical answers to vLLM's own server.

For each chat, the same messages go (a) through our HTTP endpoint with the real `openai` client,
to a `vllm serve --headless` engine over our own wire code, and (b) to `vllm serve` (its own front
end and engine, same model and engine flags, started in this run: `vllm_serve_reference`). Prompt
token ids, generated token ids, text, finish and stop reasons must be equal; prompt ids must also
equal Hugging Face's `apply_chat_template`.
"""

from __future__ import annotations


import pytest

from tests.e2e.fault_support import wait_for
from tests.support.raw_http import read_until, reset, send_chat
from tests.support.reference_venv import call_in_reference

pytestmark = [pytest.mark.real_engine, pytest.mark.serve]

CHATS = [
    [{"role": "user", "content": "Hello! What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse pirate."}, {"role": "user", "content": "Describe the sea."}],
    [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Why that one?"},
    ],
    [{"role": "user", "content": "Ünïcödé: 日本語のテキスト, emoji 🚀🌊, and ça va?"}],
    [{"role": "user", "content": [{"type": "text", "text": "Two parts:"}, {"type": "text", "text": " list content."}]}],
    [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "{\"q\": \"tabs\\tand\\nnewlines\"}"}],
]
GREEDY = {"temperature": 0.0, "max_tokens": 24}


@pytest.fixture(scope="module")
def greedy_reference(vllm_serve_reference):
    return vllm_serve_reference.answers([{"messages": chat, "sampling": GREEDY} for chat in CHATS])


def _chat(vllm_app, messages, **kwargs):
    client = vllm_app.app.openai(timeout=120)
    return client.chat.completions.create(
        model=vllm_app.model_name, messages=messages, extra_body={"return_token_ids": True, **kwargs.pop("extra_body", {})}, **kwargs
    )


def _stream_chat(vllm_app, messages, **kwargs):
    client = vllm_app.app.openai(timeout=120)
    stream = client.chat.completions.create(
        model=vllm_app.model_name, messages=messages, stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True}, **kwargs,
    )
    texts, ids, finish, stop_reason, prompt_ids, usage = {}, {}, {}, {}, None, None
    for chunk in stream:
        extra = chunk.model_extra or {}
        if extra.get("prompt_token_ids") is not None:
            prompt_ids = extra["prompt_token_ids"]
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            i = choice.index
            texts[i] = texts.get(i, "") + (choice.delta.content or "")
            ids.setdefault(i, []).extend((choice.model_extra or {}).get("token_ids") or [])
            if choice.finish_reason:
                finish[i] = choice.finish_reason
                stop_reason[i] = (choice.model_extra or {}).get("stop_reason")
    return prompt_ids, texts, ids, finish, stop_reason, usage


def test_prompt_ids_equal_hugging_face_apply_chat_template(vllm_app, greedy_reference):
    # transformers lives in the reference venv; this test (and the Serve app) run from the gateway venv.
    hf_ids = call_in_reference("tests.support.hf_reference:chat_template_ids", str(vllm_app.model_dir), CHATS)
    for chat, hf_chat_ids, ref in zip(CHATS, hf_ids, greedy_reference, strict=True):
        ours = _chat(vllm_app, chat, **GREEDY)
        assert ours.model_extra["prompt_token_ids"] == hf_chat_ids == ref.prompt_token_ids


@pytest.mark.parametrize("case", range(len(CHATS)))
def test_greedy_tokens_and_text_equal_vllm_serve(vllm_app, greedy_reference, case):
    ref = greedy_reference[case].outputs[0]
    ours = _chat(vllm_app, CHATS[case], **GREEDY)
    choice = ours.choices[0]
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert choice.model_extra.get("stop_reason") == ref.stop_reason
    assert ours.usage.completion_tokens == len(ref.token_ids)
    assert ours.usage.prompt_tokens == len(greedy_reference[case].prompt_token_ids)


@pytest.mark.parametrize("case", [0, 3])
def test_streaming_equals_vllm_serve(vllm_app, greedy_reference, case):
    ref = greedy_reference[case]
    prompt_ids, texts, ids, finish, stop_reason, usage = _stream_chat(vllm_app, CHATS[case], **GREEDY)
    assert prompt_ids == ref.prompt_token_ids
    assert ids[0] == ref.outputs[0].token_ids
    assert texts[0] == ref.outputs[0].text
    assert finish[0] == ref.outputs[0].finish_reason
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_stop_strings_n2_seed_and_max_tokens_match_vllm(vllm_app, greedy_reference, vllm_serve_reference):
    # A stop string cut from the middle of a known greedy answer.
    base_text = greedy_reference[1].outputs[0].text
    assert len(base_text) >= 10, base_text
    stop = base_text[4:7]
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "n": 2, "max_tokens": 20}
    cases = [
        {"messages": CHATS[1], "sampling": {**GREEDY, "stop": [stop]}},
        {"messages": CHATS[1], "sampling": {**GREEDY, "stop": [stop], "include_stop_str_in_output": True}},
        {"messages": CHATS[2], "sampling": sampled},
        {"messages": CHATS[0], "sampling": {"temperature": 0.0, "max_tokens": 5}},
        {"messages": CHATS[3], "sampling": {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "min_tokens": 6}},
    ]
    refs = vllm_serve_reference.answers(cases)

    r = _chat(vllm_app, CHATS[1], **GREEDY, stop=[stop])
    assert r.choices[0].message.content == refs[0].outputs[0].text
    assert r.choices[0].model_extra["token_ids"] == refs[0].outputs[0].token_ids
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("stop", stop)
    assert refs[0].outputs[0].stop_reason == stop

    r = _chat(vllm_app, CHATS[1], **GREEDY, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == refs[1].outputs[0].text

    r = _chat(vllm_app, CHATS[2], temperature=0.9, top_p=0.95, seed=1234, n=2, max_tokens=20)
    got = sorted((c.model_extra["token_ids"], c.message.content) for c in r.choices)
    want = sorted((o.token_ids, o.text) for o in refs[2].outputs)
    assert got == want

    r = _chat(vllm_app, CHATS[0], temperature=0.0, max_tokens=5)
    assert r.choices[0].model_extra["token_ids"] == refs[3].outputs[0].token_ids
    assert r.choices[0].finish_reason == refs[3].outputs[0].finish_reason == "length"

    r = _chat(vllm_app, CHATS[3], temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True, "min_tokens": 6})
    assert r.choices[0].model_extra["token_ids"] == refs[4].outputs[0].token_ids

    # Streaming with a stop string: same text, never a stop-string fragment leaked.
    _, texts, ids, finish, stop_reason, _ = _stream_chat(vllm_app, CHATS[1], **GREEDY, stop=[stop])
    assert texts[0] == refs[0].outputs[0].text and ids[0] == refs[0].outputs[0].token_ids
    assert (finish[0], stop_reason[0]) == ("stop", stop)


def test_text_completion_matches_vllm_token_prompt(vllm_app, vllm_serve_reference):
    prompt_ids = [1987, 82, 88, 434, 68, 76, 198, 300, 301]
    ref = vllm_serve_reference.answers([{"prompt_token_ids": prompt_ids, "sampling": GREEDY}])[0]
    client = vllm_app.app.openai(timeout=120)
    r = client.completions.create(model=vllm_app.model_name, prompt=prompt_ids, extra_body={"return_token_ids": True}, **GREEDY)
    assert r.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
    assert r.choices[0].text == ref.outputs[0].text


def test_chat_template_kwargs_and_reasoning_effort_render_as_vllm_serve(vllm_app, vllm_serve_reference):
    """Qwen2-VL's template declares `add_vision_id` ("Picture 1: ..." before each image), not
    `reasoning_effort` or `enable_thinking`: the prompt ids and the greedy answer equal vllm serve's."""
    from tests.support.images import image_part, image_uri

    messages = [{"role": "user", "content": [
        image_part(image_uri(120, 90, 7)), image_part(image_uri(90, 120, 8)), {"type": "text", "text": "Compare them."},
    ]}]  # fmt: skip
    kwargs = {"chat_template_kwargs": {"add_vision_id": True, "not_in_the_template": 1}, "reasoning_effort": "high"}
    ref = vllm_serve_reference.answers([{"messages": messages, "sampling": GREEDY, "chat_kwargs": kwargs}])[0]
    plain = vllm_serve_reference.answers([{"messages": messages, "sampling": GREEDY}])[0]
    assert ref.prompt_token_ids != plain.prompt_token_ids  # the kwarg changed the prompt
    ours = _chat(vllm_app, messages, extra_body=kwargs, **GREEDY)
    assert ours.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert ours.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids


def test_bad_requests_leave_the_engine_serving(vllm_app, greedy_reference):
    import httpx

    url = vllm_app.app.base_url + "/v1/chat/completions"
    bad = [
        b"{not json",
        b'{"messages": [{"role": "user", "content": 5}]}',
        b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}',
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}',
        ('{"messages": [{"role": "user", "content": "' + "lorem ipsum " * 800 + '"}]}').encode(),
    ]
    for body in bad:
        resp = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert resp.status_code == 400, (body[:80], resp.text)
        assert set(resp.json()["error"]) >= {"message", "type", "param", "code"}
    assert vllm_app.engine.is_alive()
    ours = _chat(vllm_app, CHATS[0], **GREEDY)
    assert ours.choices[0].model_extra["token_ids"] == greedy_reference[0].outputs[0].token_ids


def test_client_disconnect_leaves_no_running_request(vllm_app):
    """A client that leaves mid-stream: the engine runs its request no more.

    The engine is held still with vLLM's own `pause_scheduler("keep")` (nothing is scheduled until
    `resume_scheduler`; inputs, aborts and utility calls are still handled), so that "mid-stream" does
    not depend on the gateway outrunning the engine: the request waits in the paused engine, then a
    resume and a pause are sent together (the engine makes at most a few steps between them) until its
    first tokens reach the client, the stream is seen to stand still (the engine is paused with most of
    the 900 tokens unmade), and the client leaves then. After the gateway has sent its ABORT the engine
    is resumed: with the abort honoured it has nothing to run; without it, it would go on generating.
    (Racing the engine instead lost in CI: calls from the test process can take longer there than the
    tiny model needs for all 900 tokens.)"""
    body = {"model": vllm_app.model_name, "messages": CHATS[0], "max_tokens": 900, "ignore_eos": True, "stream": True}
    app = vllm_app.app
    handle = app.engine_handle(0)
    token, finished = b'"content":"', b'"finish_reason":"length"'

    def utility(method: str, *args):
        return handle.call_utility.remote(method, *args).result(timeout_s=30)

    def info():
        return handle.info.remote().result(timeout_s=30)

    def run_a_few_steps() -> None:
        # Sent together (one caller's calls reach the replica, and the engine, in order): the
        # engine handles both between two steps, or makes a few steps in between.
        resumed, paused = handle.call_utility.remote("resume_scheduler"), handle.call_utility.remote("pause_scheduler", "keep", False)
        resumed.result(timeout_s=30), paused.result(timeout_s=30)

    def paused_mid_stream(sock) -> bool:
        """Run the paused request until the client has tokens and the stream stands still; False if it
        finished first (the pair of calls came apart and the engine ran on)."""
        received = b""
        for _ in range(50):
            run_a_few_steps()
            received = read_until(sock, token, 2.0, received)
            if token in received:
                break
        else:
            raise AssertionError(f"no token reached the client: {received[-500:]!r}")
        for _ in range(5):  # still for a second: the engine is paused (else pause it again)
            before = len(received)
            received = read_until(sock, finished, 1.0, received)
            if finished in received:
                return False
            if len(received) == before:
                return True
            utility("pause_scheduler", "keep", False)
        raise AssertionError("the stream never stood still: the engine was not paused")

    try:
        for _ in range(3):
            utility("pause_scheduler", "keep", False)
            sent = info().requests_sent
            sock = send_chat(app.base_url, body)
            try:
                wait_for(lambda: info().requests_sent == sent + 1, 30, "ADD sent")
                mid_stream = paused_mid_stream(sock)
                assert not mid_stream or info().num_in_flight == 1
                if mid_stream:  # the engine's last scheduler stats: the request running, its KV blocks held (routing)
                    stats = info()
                    assert stats.engine_running == 1 and 0 < stats.engine_kv_cache_usage < 1, stats
            finally:
                reset(sock)
            wait_for(lambda: info().num_in_flight == 0, 10, "the gateway let the request go")
            if mid_stream:
                break
        else:
            raise AssertionError("the request finished before the client could leave, three times")
        # ADD, ABORT and utility calls share one socket, in order: this resume comes after the abort.
        utility("resume_scheduler")
        assert utility("has_work") is False, "the engine still runs the request the client left"
    finally:
        utility("resume_scheduler")
    assert app.engine_info().num_in_flight == 0
