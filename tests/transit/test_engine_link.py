"""The gateway's own protocol on the ZMQ link (`mmserve.transit.engine_link`): what an ingress replica sends comes out as it went in, and what cannot be read still names who waits for its answer."""

from __future__ import annotations

import msgspec
import pytest

from mmserve.multimodal import ImageBatchRequest
from mmserve.multimodal.types import PixelMode
from mmserve.transit.engine_link import (
    AbortRequests, ImageRequest, PreprocessorName, TextRequest, decode_link_request, encode, unreadable_request_sender,
)
from mmserve.wire import EngineCoreRequest, SamplingParams, StructuredOutputsParams


def test_link_messages_survive_their_encoding():
    """A text request with every kind of field set comes out of the engine client's decoder as it went in."""
    params = SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=5, seed=7, stop=["\n\n", "END"], stop_token_ids=[3], max_tokens=12,
        logprobs=2, logit_bias={5: -1.5, 9: 2.0}, allowed_token_ids=[1, 2, 3], bad_words=["x"],
        structured_outputs=StructuredOutputsParams(json='{"type": "object"}'),
    )
    request = EngineCoreRequest(
        "req-1", [1, 2, 3, 40000], None, params, None, 1733480000.123456, None, "salt", None,
        client_index=0, priority=3, reasoning_ended=False, reasoning_parser_kwargs={"chat_template_kwargs": {"thinking": True}},
    )
    sent = TextRequest("caller-replica", request)
    assert decode_link_request(encode(sent)) == sent
    abort = AbortRequests("caller-replica", ["req-1", "req-2"])
    assert decode_link_request(encode(abort)) == abort
    images = ImageBatchRequest(["https://example.com/a.jpg", "data:image/png;base64,AAAA"], PixelMode.HOST_NORMALIZE, "float16")
    with_images = ImageRequest("caller-replica", request, images, PreprocessorName("app", "Preprocessor"))
    assert decode_link_request(encode(with_images)) == with_images


def test_an_unreadable_text_request_still_names_who_waits_for_its_answer():
    """A request the engine client cannot decode (a caller of another version) is answered, not
    left waiting: its caller and id are found in what can be read."""
    request = EngineCoreRequest("req-9", [1, 2], None, SamplingParams(), None, 1.0, None, None, None)
    good = encode(TextRequest("caller-a", request))
    assert unreadable_request_sender(good) == ("caller-a", "req-9")
    skewed = msgspec.msgpack.encode({"type": "add", "caller": "caller-a", "request": ["req-9", "not token ids"]})
    with pytest.raises(msgspec.ValidationError):
        decode_link_request(skewed)
    assert unreadable_request_sender(skewed) == ("caller-a", "req-9")
    skewed_images = msgspec.msgpack.encode({"type": "add_images", "caller": "caller-a", "request": ["req-9"], "images": 3})
    with pytest.raises(msgspec.ValidationError):
        decode_link_request(skewed_images)
    assert unreadable_request_sender(skewed_images) == ("caller-a", "req-9")
    assert unreadable_request_sender(encode(AbortRequests("caller-a", ["req-9"]))) is None
    assert unreadable_request_sender(b"\xc1 not msgpack") is None
