"""The one error table: every internal error reaches the client with its status, Retry-After and OpenAI body."""

from __future__ import annotations

import pytest

from mmserve.engine import EngineDeadError, EngineError, EngineNotReadyError, EngineOverloadedError, InvalidRequestError, fit_max_tokens
from mmserve.multimodal.errors import ImageInputError, ImagesTooLargeError
from mmserve.transit.router import NoEngineAliveError
from mmserve.openai.errors import ERROR_TABLE, OpenAIError, internal_error, openai_error
from mmserve.transit.refusals import GatewayBusyError


@pytest.mark.parametrize(
    ("error", "status", "type_", "param", "code", "retry_after", "message"),
    [
        (InvalidRequestError("bad prompt", "messages"), 400, "invalid_request_error", "messages", None, None, "bad prompt"),
        (ImageInputError("not an image", index=1), 400, "invalid_request_error", "messages", "invalid_image", None, "image 2: not an image"),
        (ImagesTooLargeError("too many pixels", index=0), 413, "invalid_request_error", "messages", "request_too_large", None,
         "image 1: too many pixels"),
        (EngineOverloadedError("full", retry_after_s=3), 429, "rate_limit_error", None, None, 3, "full"),
        (GatewayBusyError("queue full"), 503, "service_unavailable_error", None, None, 1, "queue full"),
        (EngineNotReadyError("starting"), 503, "service_unavailable_error", None, None, 5, "no engine is ready: starting"),
        (NoEngineAliveError("all dead"), 503, "service_unavailable_error", None, None, 5, "no engine is available: all dead"),
        (EngineDeadError("gone"), 503, "service_unavailable_error", None, None, 5, "the engine serving this request failed: gone"),
        (EngineError("other"), 503, "service_unavailable_error", None, None, 5, "no engine is available: other"),
    ],
)
def test_each_internal_error_has_its_status_and_body(error, status, type_, param, code, retry_after, message):
    mapped = openai_error(error)
    assert mapped is not None and mapped.status == status and mapped.retry_after_s == retry_after
    body = mapped.body().model_dump()["error"]
    assert body == {"message": message, "type": type_, "param": param, "code": code}


def test_the_context_rule_is_a_400_with_openais_code():
    with pytest.raises(InvalidRequestError) as caught:
        fit_max_tokens(10, 60, 64)
    mapped = openai_error(caught.value)
    assert (mapped.status, mapped.param, mapped.code) == (400, "max_tokens", "context_length_exceeded")
    assert "you requested 70 tokens" in mapped.message


def test_openai_errors_pass_through_and_bugs_are_not_mapped():
    error = OpenAIError("nope", status=413, code="request_too_large")
    assert openai_error(error) is error
    assert openai_error(KeyError("x")) is None
    assert internal_error(KeyError("secret")).body().model_dump()["error"]["message"] == "internal error: KeyError"


def test_subclasses_come_before_their_bases():
    kinds = [kind for kind, _ in ERROR_TABLE]
    for i, kind in enumerate(kinds):
        assert not any(issubclass(later, kind) and later is not kind for later in kinds[i + 1:]), kind
