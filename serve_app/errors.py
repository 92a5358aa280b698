"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from .schemas import ErrorInfo, ErrorResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


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
