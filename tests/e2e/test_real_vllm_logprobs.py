"""Chat and completions logprobs and prompt logprobs equal `vllm serve`'s own, to the last bit: tokens, bytes, values and top-k order,
streamed and not, for text and image prompts, greedy and sampled, cut by a stop string; and the
same 400s for the same bad values.

`vllm serve` (its own front end and engine) runs in this test run on the same machine and the same
tiny Qwen2-VL as the headless engine behind mmserve, with the same engine flags; requests go one at
a time to each, so both engines compute the same batches.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.images import image_part, image_uri

pytestmark = [pytest.mark.real_engine, pytest.mark.serve]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TEXT = [{"role": "user", "content": "Write a short poem about the sea."}]
IMAGE = [{"role": "user", "content": [image_part(image_uri(300, 200, 1)), {"type": "text", "text": "Describe this image."}]}]


@pytest.fixture(scope="module")
def vllm_server(vllm_serve_reference):
    return vllm_serve_reference.server


def _post(base_url: str, body: dict, route: str = CHAT) -> httpx.Response:
    return httpx.post(base_url + route, json=body, timeout=300)


def _streamed_choices(base_url: str, route: str, body: dict) -> list[dict]:
    """Every streamed chunk's choices, in order."""
    choices = []
    with httpx.stream("POST", base_url + route, json={**body, "stream": True}, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += json.loads(line[len("data: "):])["choices"]
    return choices


def _streamed(base_url: str, body: dict) -> tuple[str, list[dict]]:
    """The streamed text and the logprobs entries of every chunk, in order."""
    text, entries = "", []
    for choice in _streamed_choices(base_url, CHAT, body):
        text += choice["delta"].get("content") or ""
        entries += (choice.get("logprobs") or {}).get("content") or []
    return text, entries


def _streamed_completion(base_url: str, body: dict) -> tuple[str, dict[str, list]]:
    """The streamed text and the logprobs lists of every chunk, concatenated."""
    text, lists = "", {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for choice in _streamed_choices(base_url, COMPLETIONS, body):
        text += choice["text"]
        for key, values in (choice.get("logprobs") or {}).items():
            lists[key] += values
    return text, lists


CASES = {
    "greedy-top3": {"messages": TEXT, "max_tokens": 24, "temperature": 0.0, "logprobs": True, "top_logprobs": 3},
    "greedy-no-top": {"messages": TEXT, "max_tokens": 12, "temperature": 0.0, "logprobs": True},
    "sampled-top2": {"messages": TEXT, "max_tokens": 24, "temperature": 1.0, "seed": 7, "logprobs": True, "top_logprobs": 2},
    "all-top20": {"messages": TEXT, "max_tokens": 6, "temperature": 0.0, "logprobs": True, "top_logprobs": 20},
    "image": {"messages": IMAGE, "max_tokens": 12, "temperature": 0.0, "logprobs": True, "top_logprobs": 4},
}


@pytest.mark.parametrize("case", list(CASES))
def test_chat_logprobs_equal_vllm_serve(vllm_app, vllm_server, case):
    body = {"model": vllm_app.model_name, **CASES[case]}
    ours, theirs = _post(vllm_app.app.base_url, body), _post(vllm_server.base_url, body)
    assert ours.status_code == theirs.status_code == 200, (ours.text[:500], theirs.text[:500])
    ours_choice, their_choice = ours.json()["choices"][0], theirs.json()["choices"][0]
    assert ours_choice["message"]["content"] == their_choice["message"]["content"]
    assert ours_choice["logprobs"] == their_choice["logprobs"]
    assert len(ours_choice["logprobs"]["content"]) == ours.json()["usage"]["completion_tokens"]


def test_streamed_logprobs_equal_vllm_serve_and_the_whole_answer(vllm_app, vllm_server):
    body = {"model": vllm_app.model_name, **CASES["greedy-top3"]}
    ours_text, ours = _streamed(vllm_app.app.base_url, body)
    their_text, theirs = _streamed(vllm_server.base_url, body)
    assert ours_text == their_text
    assert ours == theirs
    whole = _post(vllm_app.app.base_url, body).json()["choices"][0]["logprobs"]["content"]
    assert ours == whole


def test_logprobs_end_where_a_stop_string_cuts_the_answer(vllm_app, vllm_server):
    body = {"model": vllm_app.model_name, **CASES["greedy-top3"]}
    full = _post(vllm_server.base_url, body).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    body["stop"] = [stop]
    ours, theirs = _post(vllm_app.app.base_url, body).json(), _post(vllm_server.base_url, body).json()
    assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"] == "stop"
    assert ours["choices"][0]["logprobs"] == theirs["choices"][0]["logprobs"]
    assert len(ours["choices"][0]["logprobs"]["content"]) < body["max_tokens"]


@pytest.mark.parametrize(
    ("route", "fields"),
    [
        (CHAT, {"logprobs": True, "top_logprobs": 21}), (CHAT, {"top_logprobs": 2}), (CHAT, {"logprobs": True, "top_logprobs": -2}),
        (COMPLETIONS, {"logprobs": 21}), (COMPLETIONS, {"logprobs": -2}),
        (CHAT, {"prompt_logprobs": 21}), (CHAT, {"prompt_logprobs": -2}), (CHAT, {"prompt_logprobs": 1, "stream": True}),
        (COMPLETIONS, {"prompt_logprobs": -1}), (COMPLETIONS, {"prompt_logprobs": 2, "stream": True}),
    ],
)
def test_bad_logprobs_values_are_refused_as_vllm_refuses_them(vllm_app, vllm_server, route, fields):
    prompt = {"messages": TEXT} if route == CHAT else {"prompt": "The sea is"}
    body = {"model": vllm_app.model_name, "max_tokens": 4, **prompt, **fields}
    ours, theirs = _post(vllm_app.app.base_url, body, route), _post(vllm_server.base_url, body, route)
    assert ours.status_code == theirs.status_code == 400, (ours.text, theirs.text)
    assert ours.json()["error"]["message"] in theirs.json()["error"]["message"], (ours.text, theirs.text)


COMPLETION_CASES = {
    "greedy-3": {"prompt": "The sea is", "max_tokens": 24, "temperature": 0.0, "logprobs": 3},
    "greedy-0": {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.0, "logprobs": 0},
    "sampled-5": {"prompt": "The sea is", "max_tokens": 16, "temperature": 1.0, "seed": 3, "logprobs": 5},
}


@pytest.mark.parametrize("case", list(COMPLETION_CASES))
def test_completion_logprobs_equal_vllm_serve_streamed_and_not(vllm_app, vllm_server, case):
    body = {"model": vllm_app.model_name, **COMPLETION_CASES[case]}
    ours, theirs = _post(vllm_app.app.base_url, body, COMPLETIONS), _post(vllm_server.base_url, body, COMPLETIONS)
    assert ours.status_code == theirs.status_code == 200, (ours.text[:500], theirs.text[:500])
    assert ours.json()["choices"][0]["text"] == theirs.json()["choices"][0]["text"]
    assert ours.json()["choices"][0]["logprobs"] == theirs.json()["choices"][0]["logprobs"]
    ours_text, ours_lists = _streamed_completion(vllm_app.app.base_url, body)
    their_text, their_lists = _streamed_completion(vllm_server.base_url, body)
    assert (ours_text, ours_lists) == (their_text, their_lists)
    assert ours_lists == ours.json()["choices"][0]["logprobs"]


PROMPT_CASES = {
    "chat-text-3": (CHAT, {"messages": TEXT, "max_tokens": 4, "temperature": 0.0, "prompt_logprobs": 3}),
    "chat-text-0-with-logprobs": (CHAT, {"messages": TEXT, "max_tokens": 4, "temperature": 0.0, "prompt_logprobs": 0,
                                         "logprobs": True, "top_logprobs": 2}),
    # ≈70 positions × 3 entries: the tensors travel as out-of-band frames.
    "chat-image-2": (CHAT, {"messages": IMAGE, "max_tokens": 4, "temperature": 0.0, "prompt_logprobs": 2}),
    "completion-5": (COMPLETIONS, {"prompt": "Once upon a time, by the sea, there was a", "max_tokens": 4,
                                   "temperature": 0.0, "prompt_logprobs": 5}),
    "completion-20-with-logprobs": (COMPLETIONS, {"prompt": "The sea is", "max_tokens": 3, "temperature": 0.0,
                                                  "prompt_logprobs": 20, "logprobs": 1}),
}


@pytest.mark.parametrize("case", list(PROMPT_CASES))
def test_prompt_logprobs_equal_vllm_serve(vllm_app, vllm_server, case):
    route, fields = PROMPT_CASES[case]
    body = {"model": vllm_app.model_name, **fields}
    ours, theirs = _post(vllm_app.app.base_url, body, route), _post(vllm_server.base_url, body, route)
    assert ours.status_code == theirs.status_code == 200, (ours.text[:500], theirs.text[:500])
    if route == CHAT:
        ours_positions, their_positions = ours.json()["prompt_logprobs"], theirs.json()["prompt_logprobs"]
        assert ours.json()["choices"][0].get("logprobs") == theirs.json()["choices"][0]["logprobs"]
    else:
        ours_positions, their_positions = ours.json()["choices"][0]["prompt_logprobs"], theirs.json()["choices"][0]["prompt_logprobs"]
        assert ours.json()["choices"][0].get("logprobs") == theirs.json()["choices"][0]["logprobs"]
    assert ours_positions == their_positions
    assert ours_positions[0] is None and len(ours_positions) == ours.json()["usage"]["prompt_tokens"]
    assert all(len(entries) >= 1 for entries in ours_positions[1:])


ECHO_CASES = {
    "text": {"prompt": "Once upon a time, by the sea,", "max_tokens": 8, "temperature": 0.0, "echo": True},
    "text-logprobs-2": {"prompt": "The sea is", "max_tokens": 8, "temperature": 0.0, "echo": True, "logprobs": 2},
    "tokens-logprobs-0": {"prompt": [785, 1396, 374, 264, 12], "max_tokens": 6, "temperature": 0.0, "echo": True, "logprobs": 0},
    "text-logprobs-1-prompt-4": {"prompt": "The sea is", "max_tokens": 5, "temperature": 0.0, "echo": True, "logprobs": 1,
                                 "prompt_logprobs": 4},
    "with-token-ids": {"prompt": "The sea is", "max_tokens": 5, "temperature": 0.0, "echo": True, "return_token_ids": True},
    "prompt-alone-logprobs-1": {"prompt": "Once upon a time", "max_tokens": 0, "temperature": 0.0, "echo": True, "logprobs": 1},
    "prompt-alone": {"prompt": "The sea is", "max_tokens": 0, "echo": True},
}


@pytest.mark.parametrize("case", list(ECHO_CASES))
def test_echo_equals_vllm_serve_streamed_and_not(vllm_app, vllm_server, case):
    body = {"model": vllm_app.model_name, **ECHO_CASES[case]}
    ours, theirs = _post(vllm_app.app.base_url, body, COMPLETIONS), _post(vllm_server.base_url, body, COMPLETIONS)
    assert ours.status_code == theirs.status_code == 200, (ours.text[:500], theirs.text[:500])
    ours_choice, their_choice = ours.json()["choices"][0], theirs.json()["choices"][0]
    for key in ("text", "logprobs", "prompt_logprobs", "token_ids", "prompt_token_ids", "finish_reason"):
        assert ours_choice.get(key) == their_choice.get(key), key
    assert ours.json()["usage"]["completion_tokens"] == theirs.json()["usage"]["completion_tokens"]
    if not body.get("return_token_ids") and isinstance(body["prompt"], str):
        assert ours_choice["text"].startswith(body["prompt"])
    if "prompt_logprobs" in body:  # streamed, refused by both
        stream = {**body, "stream": True}
        ours, theirs = _post(vllm_app.app.base_url, stream, COMPLETIONS), _post(vllm_server.base_url, stream, COMPLETIONS)
        assert ours.status_code == theirs.status_code == 400, (ours.text, theirs.text)
    elif "logprobs" in body:
        ours_text, ours_lists = _streamed_completion(vllm_app.app.base_url, body)
        their_text, their_lists = _streamed_completion(vllm_server.base_url, body)
        assert (ours_text, ours_lists) == (their_text, their_lists)
        assert ours_text == ours_choice["text"] and ours_lists == ours_choice["logprobs"]
    else:
        ours_text, _ = _streamed_completion(vllm_app.app.base_url, body)
        their_text, _ = _streamed_completion(vllm_server.base_url, body)
        assert ours_text == their_text == ours_choice["text"]
