"""The one table from internal errors to HTTP: each error's status and OpenAI error body.

Lower layers raise typed errors that know nothing of HTTP (`mmserve.engine`, `mmserve.transit.engine_link`,
`mmserve.multimodal`, the engine router); `openai_error` turns any of them into an `OpenAIError`,
whose body is OpenAI's JSON: `{"error": {"message", "type", "param", "code"}}`. The ingress
recognises errors by type, here, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable

from mmserve.engine import EngineDeadError, EngineError, EngineNotReadyError, EngineOverloadedError, InvalidRequestError
from mmserve.multimodal.errors import ImageInputError, ImagesTooLargeError
from mmserve.transit.refusals import GatewayBusyError

from mmserve.transit.router import NoEngineAliveError
from .protocol import ErrorInfo, ErrorResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}
# A request that found no engine ready, or lost its engine, may try again after this long.
ENGINE_RETRY_AFTER_S = 5


class OpenAIError(Exception):
    """An error the client should see, with its HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message,
                type=_TYPE_BY_STATUS.get(self.status, "invalid_request_error"),
                param=self.param,
                code=self.code,
            )
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, status=400, param=param, code=code)


# Every internal error a request can meet, most specific type first: (type, how it reaches the client).
ERROR_TABLE: list[tuple[type[BaseException], Callable[[BaseException], OpenAIError]]] = [
    (OpenAIError, lambda e: e),  # type: ignore[list-item, return-value]
    # The client's mistakes.
    (InvalidRequestError, lambda e: bad_request(str(e), e.param, e.code)),  # type: ignore[attr-defined]
    # Images needing more pixels decoded at once than a preprocessor replica ever holds.
    (ImagesTooLargeError, lambda e: OpenAIError(str(e), status=413, param="messages", code="request_too_large")),
    (ImageInputError, lambda e: bad_request(str(e), "messages", "invalid_image")),
    # Full: one engine (429, that engine's Retry-After), or a tier between (503).
    (EngineOverloadedError, lambda e: OpenAIError(str(e), status=429, retry_after_s=e.retry_after_s)),  # type: ignore[attr-defined]
    (GatewayBusyError, lambda e: OpenAIError(str(e), status=503, retry_after_s=e.retry_after_s)),  # type: ignore[attr-defined]
    # No engine to serve the request, or the one serving it died.
    (EngineNotReadyError, lambda e: OpenAIError(f"no engine is ready: {e}", status=503, retry_after_s=ENGINE_RETRY_AFTER_S)),
    (NoEngineAliveError, lambda e: OpenAIError(f"no engine is available: {e}", status=503, retry_after_s=ENGINE_RETRY_AFTER_S)),
    (EngineDeadError, lambda e: OpenAIError(
        f"the engine serving this request failed: {e}", status=503, retry_after_s=ENGINE_RETRY_AFTER_S)),
    (EngineError, lambda e: OpenAIError(f"no engine is available: {e}", status=503, retry_after_s=ENGINE_RETRY_AFTER_S)),
]


def openai_error(exc: BaseException) -> OpenAIError | None:
    """The client's view of `exc`, or None for an error of ours (an unexpected bug: a 500 with
    its traceback logged, see `internal_error`)."""
    for kind, make in ERROR_TABLE:
        if isinstance(exc, kind):
            return make(exc)
    return None


def internal_error(exc: BaseException) -> OpenAIError:
    """What the client sees of a bug of ours: its type, never its message."""
    return OpenAIError(f"internal error: {type(exc).__name__}", status=500)
