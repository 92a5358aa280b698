"""The serving stages end to end without Ray: input processing, fan-out, output processing, one response or SSE."""

from __future__ import annotations

import asyncio
import json

import pytest

from mmserve.engine import EngineDeadError, admit
from mmserve.transit.router import EngineLimits
from mmserve.openai.errors import OpenAIError, openai_error
from mmserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from mmserve.openai.serving import OpenAIServer
from mmserve.openai.sse import DONE, ErrorEvent
from mmserve.transit.engine_link import EngineEvent
from mmserve.wire import EngineCoreOutput, FinishReason
from serve_app.config import AppConfig
from serve_app.settings import serving_settings

MAX_MODEL_LEN = 64


class ScriptedRouter:
    """Answers every engine request with `tokens`, one per output; can die after `die_after` outputs."""

    def __init__(self, tokens: list[int], die_after: int | None = None) -> None:
        self.tokens, self.die_after = tokens, die_after
        self.requests = []

    async def limits(self, wait: bool = True) -> EngineLimits:
        return EngineLimits(max_model_len=MAX_MODEL_LEN, engine_kind="mmserve-builtin")

    def preprocess(self, request, group: str = "", choices: int = 1):
        return request

    async def generate(self, request, images=None):
        request = admit(request, MAX_MODEL_LEN)
        self.requests.append(request)
        for i, token in enumerate(self.tokens):
            if self.die_after is not None and i == self.die_after:
                raise EngineDeadError("engine went away")
            last = i == len(self.tokens) - 1
            yield EngineEvent(outputs=[EngineCoreOutput(request.request_id, [token], finish_reason=FinishReason.LENGTH if last else None)])


def _server(router: ScriptedRouter, **limits) -> OpenAIServer:
    return OpenAIServer(serving_settings(AppConfig.model_validate({"limits": limits})), router)


def _tokens(server: OpenAIServer, text: str) -> list[int]:
    return server.inputs.tokenizer.encode(text, add_special_tokens=False)


async def _events(stream) -> list[str]:
    """SSE events as text (delta chunks come as bytes, the others as str; `ErrorEvent`s keep their type)."""
    return [event.decode() if isinstance(event, bytes) else event async for event in stream]


def test_a_chat_response_is_built_once_with_usage_and_choices():
    router = ScriptedRouter([])
    server = _server(router)
    router.tokens = _tokens(server, " hello world")
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "n": 2, "seed": 4, "max_tokens": 8})
    response = asyncio.run(server.chat(request))
    assert [c.message.content for c in response.choices] == [" hello world"] * 2
    assert [c.finish_reason for c in response.choices] == ["length"] * 2
    prompt_len = len(router.requests[0].prompt_token_ids)
    assert response.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": prompt_len, "completion_tokens": 2 * len(router.tokens), "total_tokens": prompt_len + 2 * len(router.tokens),
    }
    assert sorted(r.sampling_params.seed for r in router.requests) == [4, 5]
    assert response.model == server.model_name and response.id.startswith("chatcmpl-")


def test_a_stop_string_ends_a_completion_and_is_its_stop_reason():
    router = ScriptedRouter([])
    server = _server(router)
    router.tokens = _tokens(server, " one two three four")
    response = asyncio.run(server.completion(CompletionRequest.model_validate({"prompt": "Count", "stop": [" three"], "max_tokens": 10})))
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (" one two", "stop", " three")


def test_a_stream_has_deltas_usage_and_done():
    router = ScriptedRouter([])
    server = _server(router)
    router.tokens = _tokens(server, " a b c")
    request = CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 5})

    async def run():
        return await _events(await server.completion(request))

    events = asyncio.run(run())
    assert events[-1] == DONE
    bodies = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["text"] for b in bodies for c in b["choices"]) == " a b c"
    assert bodies[-1]["usage"]["completion_tokens"] == len(router.tokens)


def test_a_stream_that_fails_after_its_start_ends_with_a_typed_error_event():
    router = ScriptedRouter([])
    server = _server(router)
    router.tokens, router.die_after = _tokens(server, " a b c d"), 2
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 8})

    async def run():
        return await _events(await server.chat(request))

    events = asyncio.run(run())
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert len(errors) == 1 and events[-1] == DONE
    error = json.loads(errors[0].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable_error" and "engine went away" in error["message"]
    assert not any(isinstance(e, ErrorEvent) for e in events[: events.index(errors[0])])


def _client_error(coroutine) -> OpenAIError:
    """What the client gets for a refused request (the ingress maps every error by `openai_error`)."""
    with pytest.raises(Exception) as caught:
        asyncio.run(coroutine)
    error = openai_error(caught.value)
    assert error is not None, caught.value
    return error


def test_the_context_rule_refuses_before_any_engine_request():
    router = ScriptedRouter([5])
    server = _server(router)
    error = _client_error(server.completion(CompletionRequest.model_validate({"prompt": [1] * 10, "max_tokens": 60})))
    assert (error.status, error.param, error.code) == (400, "max_tokens", "context_length_exceeded")
    error = _client_error(server.completion(CompletionRequest.model_validate({"prompt": [1] * MAX_MODEL_LEN})))
    assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")
    # limits.max_prompt_tokens, below the context
    error = _client_error(_server(router, max_prompt_tokens=8).completion(CompletionRequest.model_validate({"prompt": [1] * 9})))
    assert (error.status, error.code) == (400, "context_length_exceeded")
    assert router.requests == []


def test_an_unset_max_tokens_is_what_is_left_of_the_context():
    router = ScriptedRouter([5])
    asyncio.run(_server(router).completion(CompletionRequest.model_validate({"prompt": [1] * 10})))
    assert router.requests[0].sampling_params.max_tokens == MAX_MODEL_LEN - 10


def test_the_model_name_is_checked():
    error = _client_error(_server(ScriptedRouter([5])).completion(CompletionRequest.model_validate({"prompt": "x", "model": "other"})))
    assert (error.status, error.code) == (400, "model_not_found")


def test_models_answer_without_waiting_for_an_engine():
    models = asyncio.run(_server(ScriptedRouter([5])).models())
    (card,) = models.data
    assert (card.id, card.max_model_len, card.engine) == ("mmserve-builtin", MAX_MODEL_LEN, "mmserve-builtin")


def test_logprobs_are_refused_on_the_built_in_engine_and_checked_against_max_logprobs():
    server = _server(ScriptedRouter([1]), max_logprobs=5)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(server.chat(ChatCompletionRequest.model_validate({**chat, "logprobs": True})))
    assert refused.value.status == 400 and refused.value.param == "logprobs" and "built-in engine" in refused.value.message
    from mmserve.openai import request_checks

    request = ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 6})
    with pytest.raises(OpenAIError, match="Requested sample logprobs of 6, which is greater than max allowed: 5"):
        request_checks.chat_logprobs(request, 5, 1000, "vllm")
    assert request_checks.chat_logprobs(request, -1, 1000, "vllm") == 6
    assert request_checks.chat_logprobs(ChatCompletionRequest.model_validate(chat), 5, 1000, "vllm") is None
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(server.chat(ChatCompletionRequest.model_validate({**chat, "prompt_logprobs": 0})))
    assert refused.value.status == 400 and refused.value.param == "prompt_logprobs" and "built-in engine" in refused.value.message
    prompt_request = ChatCompletionRequest.model_validate({**chat, "prompt_logprobs": -1})
    with pytest.raises(OpenAIError, match="Requested prompt logprobs of 1000, which is greater than max allowed: 5"):
        request_checks.prompt_logprobs(prompt_request, 5, 1000, "vllm")
    assert request_checks.prompt_logprobs(prompt_request, -1, 1000, "vllm") == -1


def _reasoning_server(router: ScriptedRouter, tmp_path, parser: str = "deepseek_r1") -> OpenAIServer:
    from tests.support.tiny_models import write_think_tokenizer_files

    model_dir = write_think_tokenizer_files(tmp_path / "model")
    config = AppConfig.model_validate({"model": str(model_dir), "served_model_name": "m", "reasoning_parser": parser})
    return OpenAIServer(serving_settings(config), router)


def test_with_a_reasoning_parser_the_answer_is_split_into_reasoning_and_content(tmp_path):
    router = ScriptedRouter([])
    server = _reasoning_server(router, tmp_path)
    router.tokens = _tokens(server, "<think>Two and two.</think>Four.")
    chat = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 32}
    response = asyncio.run(server.chat(ChatCompletionRequest.model_validate(chat)))
    message = response.choices[0].message
    assert (message.reasoning, message.content) == ("Two and two.", "Four.")
    reasoning_tokens = len(_tokens(server, "Two and two."))
    assert response.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert router.requests[-1].reasoning_ended is False  # the prompt leaves no think tags closed

    hidden = asyncio.run(server.chat(ChatCompletionRequest.model_validate({**chat, "include_reasoning": False})))
    assert (hidden.choices[0].message.reasoning, hidden.choices[0].message.content) == (None, "Four.")
    assert router.requests[-1].reasoning_ended is True

    streamed = ChatCompletionRequest.model_validate({**chat, "stream": True, "stream_options": {"include_usage": True}})

    async def run():
        return await _events(await server.chat(streamed))

    events = asyncio.run(run())
    assert events[-1] == DONE
    deltas = [json.loads(e.removeprefix("data: "))["choices"][0]["delta"] for e in events[1:-2]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "Two and two."
    assert "".join(d.get("content") or "" for d in deltas) == "Four."
    assert json.loads(events[-2].removeprefix("data: "))["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}


def test_qwen3_keeps_special_tokens_and_tells_the_engine_whether_the_request_thinks(tmp_path):
    """vLLM's parser-engine `adjust_request` turns `skip_special_tokens` off (the grammar drops or names
    them); the engine gets the template kwargs the parser was built with (`reasoning_parser_kwargs`)."""
    router = ScriptedRouter([])
    server = _reasoning_server(router, tmp_path, "qwen3")
    router.tokens = _tokens(server, "Two and two.</think>Four.")
    chat = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 32, "skip_special_tokens": True}
    message = asyncio.run(server.chat(ChatCompletionRequest.model_validate(chat))).choices[0].message
    assert (message.reasoning, message.content) == ("Two and two.", "Four.")
    sent = router.requests[-1]
    assert sent.sampling_params.skip_special_tokens is False
    assert sent.reasoning_parser_kwargs == {"chat_template_kwargs": {"add_generation_prompt": True, "continue_final_message": False}}
    assert sent.reasoning_ended is False  # the prompt opens no reasoning, and qwen3 waits for it to end

    not_thinking = {**chat, "chat_template_kwargs": {"enable_thinking": False}}
    message = asyncio.run(server.chat(ChatCompletionRequest.model_validate(not_thinking))).choices[0].message
    assert (message.reasoning, message.content) == (None, "Two and two.</think>Four.")
    sent = router.requests[-1]
    assert sent.reasoning_parser_kwargs["chat_template_kwargs"]["enable_thinking"] is False and sent.reasoning_ended is True

    deepseek = _reasoning_server(router, tmp_path / "deepseek")
    asyncio.run(deepseek.chat(ChatCompletionRequest.model_validate(chat)))
    assert router.requests[-1].sampling_params.skip_special_tokens is True


def test_a_reasoning_parser_whose_tags_the_tokenizer_lacks_stops_the_server_at_start():
    with pytest.raises(ValueError, match="needs <think> and </think> as tokens"):
        OpenAIServer(serving_settings(AppConfig.model_validate({"reasoning_parser": "deepseek_r1"})), ScriptedRouter([]))


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_structured_outputs_are_parsed_off_the_event_loop(monkeypatch, endpoint):
    """The grammar compiler's parse (up to ≈40 ms for a 256 KiB grammar, 5 s for a regex) runs in the
    prompt pool: the event loop keeps serving other streams meanwhile; its refusal is still a 400."""
    from mmserve.openai import grammar_check
    import threading

    seen: list[str] = []
    real = grammar_check.check_ebnf

    def recording(grammar: str) -> None:
        seen.append(threading.current_thread().name)
        real(grammar)

    monkeypatch.setattr(grammar_check, "check_ebnf", recording)
    server = _server(ScriptedRouter([_tokens(_server(ScriptedRouter([])), "a")[0]]))
    body = {"model": server.model_name, "max_tokens": 1, "structured_outputs": {"grammar": 'root ::= "a"'}}

    def send(fields: dict):
        if endpoint == "chat":
            return asyncio.run(server.chat(ChatCompletionRequest.model_validate({**body, **fields, "messages": [{"role": "user", "content": "hi"}]})))
        return asyncio.run(server.completion(CompletionRequest.model_validate({**body, **fields, "prompt": "hi"})))

    assert send({}).choices[0].finish_reason == "length"
    assert seen and all(name.startswith("mmserve-prompt") for name in seen), seen
    with pytest.raises(OpenAIError) as refused:
        send({"structured_outputs": {"grammar": "root ::= b"}})
    assert refused.value.status == 400 and refused.value.param == "structured_outputs"
