"""The bad-request corpus: every entry gets a 4xx in OpenAI's error shape, before any engine.

Against the built-in engine: one test per entry. Against a real vLLM engine: the whole corpus
in one test (none of it reaches the engine), then valid requests at the edges of vLLM's fields
(which do, and are served), then proof that the same engine process still serves a greedy
request with the same tokens as before.
"""

from __future__ import annotations

import collections

import httpx
import pytest

from .corpus import CORPUS, SERVED_WITH_A_TOOL_CALL_PARSER, BadRequest

pytestmark = pytest.mark.serve

HEADERS = {"content-type": "application/json"}


def _check(client: httpx.Client, base_url: str, case: BadRequest) -> str | None:
    """None if the response is right, else what is wrong with it."""
    try:
        resp = client.post(base_url + case.endpoint, content=case.content(), headers=HEADERS)
    except httpx.HTTPError as exc:
        return f"{case.id}: transport error {exc!r}"
    if resp.status_code not in case.statuses:
        return f"{case.id}: status {resp.status_code} not in {case.statuses}: {resp.text[:300]}"
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{case.id}: not OpenAI's error shape: {resp.text[:300]}"
    if set(error) < {"message", "type", "param", "code"}:
        return f"{case.id}: error lacks fields: {error}"
    if not isinstance(error["message"], str) or not error["message"].strip():
        return f"{case.id}: empty error message: {error}"
    if case.param is not None and error["param"] != case.param:
        return f"{case.id}: param {error['param']!r}, expected {case.param!r} ({error['message'][:200]})"
    return None


def test_corpus_is_large_and_covers_every_category():
    by_category = collections.Counter(case.category for case in CORPUS)
    assert len(CORPUS) >= 150, by_category
    assert set(by_category) == {
        "malformed", "wrong types", "messages", "prompts", "sampling ranges", "structured outputs", "tools", "images"
    }
    assert {case.endpoint for case in CORPUS} == {"/v1/chat/completions", "/v1/completions"}
    assert any(b'"stream": true' in case.content() for case in CORPUS)


@pytest.fixture(scope="module")
def builtin_client():
    with httpx.Client(timeout=120) as client:
        yield client


@pytest.mark.parametrize("case", CORPUS, ids=[case.id for case in CORPUS])
def test_builtin_app_refuses(builtin_app, builtin_client, case):
    problem = _check(builtin_client, builtin_app.base_url, case)
    assert problem is None, problem


def test_builtin_engine_never_saw_the_corpus(builtin_app, builtin_client):
    sent_before = builtin_app.engine_info().requests_sent
    problems = [p for case in CORPUS[::7] if (p := _check(builtin_client, builtin_app.base_url, case)) is not None]
    assert not problems, "\n".join(problems)
    assert builtin_app.engine_info().requests_sent == sent_before


# Valid requests at the edges of vLLM's fields: each reaches the engine and must be served.
VALID_EDGES: list[dict] = [
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": {"regex": "[0-9]{3}"}},
    {"structured_outputs": {"json": "{\"type\": \"object\"}"}},
    {"structured_outputs": {"grammar": "root ::= \"a\" | \"b\""}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
    {"n": 2, "temperature": 0.7, "top_k": -1},
    {"max_tokens": 1, "min_tokens": 1, "seed": 2**63 - 1, "temperature": 2.0, "top_p": 1e-9},
    {"stop": ["x" * 512] * 16, "presence_penalty": 2.0, "frequency_penalty": -2.0, "repetition_penalty": 2.0},
]


# Valid, but they shape a real model's token distribution, which the built-in engine has not: a 400
# naming the field, as its logprobs are (a vLLM engine serves them: the real engine's test below).
BUILTIN_REFUSES = [{"bad_words": ["sea"]}, {"allowed_token_ids": [1, 2, 3, 300]}, {"logit_bias": {"5": 100, "7": -100}}]


@pytest.mark.parametrize("fields", BUILTIN_REFUSES, ids=lambda fields: next(iter(fields)))
def test_builtin_app_refuses_what_its_engine_cannot_honour_naming_the_field(builtin_app, builtin_client, fields):
    [name] = fields
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}), ("/v1/completions", {"prompt": "hi"})):
        resp = builtin_client.post(builtin_app.base_url + path, json={**body, "max_tokens": 4, **fields})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == name, resp.text
        assert "built-in engine" in resp.json()["error"]["message"]


@pytest.mark.parametrize("fields", VALID_EDGES)
def test_builtin_app_accepts_valid_vllm_fields(builtin_app, builtin_client, fields):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    resp = builtin_client.post(builtin_app.base_url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    resp = builtin_client.post(builtin_app.base_url + "/v1/completions",
                               json={"prompt": "hi", "max_tokens": 4, **fields})
    assert resp.status_code == 200, resp.text


@pytest.mark.real_engine
def test_real_vllm_engine_survives_the_whole_corpus(vllm_app):
    app = vllm_app.app
    greedy = {
        "model": vllm_app.model_name,
        "messages": [{"role": "user", "content": "Hello! What is the capital of France?"}],
        "temperature": 0.0,
        "max_tokens": 16,
        "return_token_ids": True,
    }
    pid = vllm_app.engine.pid
    with httpx.Client(timeout=120) as client:
        before = client.post(app.base_url + "/v1/chat/completions", json=greedy)
        assert before.status_code == 200, before.text
        sent_before = app.engine_info().requests_sent
        # The session app has a tool-call parser (tests/conftest.py): it serves what needs one.
        refused = [case for case in CORPUS if case.id not in SERVED_WITH_A_TOOL_CALL_PARSER]
        problems = [p for case in refused if (p := _check(client, app.base_url, case)) is not None]
        assert not problems, "\n".join(problems)
        # Nothing of the corpus reached the engine: every refusal happened in the gateway.
        assert app.engine_info().requests_sent == sent_before
        # What does reach it, valid requests at the edges of vLLM's fields, is served ...
        for fields in VALID_EDGES:
            for endpoint, body in (("/v1/chat/completions", {"messages": greedy["messages"]}), ("/v1/completions", {"prompt": "hi"})):
                resp = client.post(app.base_url + endpoint, json={"model": vllm_app.model_name, "max_tokens": 4, **body, **fields})
                assert resp.status_code == 200, (fields, resp.text[:300])
        assert app.engine_info().requests_sent >= sent_before + 2 * len(VALID_EDGES)
        # ... and leaves the engine answering as before.
        after = client.post(app.base_url + "/v1/chat/completions", json=greedy)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["token_ids"] == before.json()["choices"][0]["token_ids"]
    assert after.json()["choices"][0]["message"]["content"] == before.json()["choices"][0]["message"]["content"]
    assert vllm_app.engine.is_alive()
    assert vllm_app.engine.pid == pid
    info = app.engine_info()
    assert info.state == "ready", info


@pytest.mark.real_engine
def test_real_vllm_engine_accepts_valid_structured_outputs(vllm_app):
    """The checks refuse only what vLLM refuses: valid constraints reach the engine and hold."""
    url = vllm_app.app.base_url + "/v1/chat/completions"
    base = {"model": vllm_app.model_name, "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 12,
            "temperature": 0.0}
    with httpx.Client(timeout=180) as client:
        r = client.post(url, json={**base, "structured_outputs": {"choice": ["yes", "no", "a \"quoted\" one"]}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] in ("yes", "no", 'a "quoted" one')
        r = client.post(url, json={**base, "structured_outputs": {"regex": "[0-9]{3}"}})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["message"]["content"]) == 3
        assert r.json()["choices"][0]["message"]["content"].isdigit()
        r = client.post(url, json={**base, "max_tokens": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}})
        assert r.status_code == 200, r.text
        r = client.post(url, json={**base, "bad_words": ["the"], "allowed_token_ids": list(range(100, 400)),
                                   "return_token_ids": True})
        assert r.status_code == 200, r.text
        token_ids = r.json()["choices"][0]["token_ids"]
        assert token_ids and all(100 <= t < 400 for t in token_ids), token_ids
    assert vllm_app.engine.is_alive()
    assert vllm_app.app.engine_info().state == "ready"
