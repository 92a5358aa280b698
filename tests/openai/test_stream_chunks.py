"""Delta chunks rendered with msgspec are byte for byte what the pydantic models (and so vLLM's server) send."""

from __future__ import annotations

import pytest

from mmserve.openai.output_processing import ChoiceDelta
from mmserve.openai.protocol import ChatCompletionChunk, ChatCompletionStreamChoice, CompletionChoice, CompletionChunk, DeltaMessage
from mmserve.openai.sse import sse
from mmserve.openai.stream_chunks import DeltaChunks

TEXTS = ["", "Hello", " wörld ✓ 漢字 🙂", 'quote " backslash \\ slash /', "ctrl \n\t\r\b\f \x00\x1f \x7f", "\u2028\u2029", "<|im_end|>"]
ENDINGS = [(None, None), ("stop", None), ("stop", "STOP"), ("stop", 151645), ("length", None)]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason, stop_reason", ENDINGS)
@pytest.mark.parametrize("with_ids", [False, True])
def test_chat_delta_chunks_equal_the_pydantic_rendering(text, finish_reason, stop_reason, with_ids):
    delta = ChoiceDelta(2, text, [5, 151645], finish_reason, stop_reason)
    expected = sse(ChatCompletionChunk(
        id="chatcmpl-é1", created=1796314356, model="m/ü", choices=[ChatCompletionStreamChoice(
            index=2, delta=DeltaMessage(content=text), finish_reason=finish_reason, stop_reason=stop_reason,
            token_ids=delta.token_ids if with_ids else None,
        )],
    ).model_dump_json(exclude_none=True)).encode()
    got = DeltaChunks("chat.completion.chunk", "chatcmpl-é1", 1796314356, "m/ü").chat(delta, with_ids)
    assert got == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason, stop_reason", ENDINGS)
@pytest.mark.parametrize("prompt_ids", [None, [1, 2, 3]])
def test_completion_delta_chunks_equal_the_pydantic_rendering(text, finish_reason, stop_reason, prompt_ids):
    delta = ChoiceDelta(0, text, [], finish_reason, stop_reason)
    expected = sse(CompletionChunk(
        id="cmpl-1", created=7, model="m", choices=[CompletionChoice(
            index=0, text=text, finish_reason=finish_reason, stop_reason=stop_reason,
            token_ids=delta.token_ids, prompt_token_ids=prompt_ids,
        )],
    ).model_dump_json(exclude_none=True)).encode()
    got = DeltaChunks("text_completion", "cmpl-1", 7, "m").completion(delta, True, prompt_ids)
    assert got == expected
