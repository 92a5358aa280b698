"""Errors an engine client raises to its callers."""


class EngineError(Exception):
    """Base class: the request could not be served by this engine."""


class EngineNotReadyError(EngineError):
    """The engine has not completed its handshake yet (or never will)."""


class EngineDeadError(EngineError):
    """The engine died, hung or went away; every open request on it has failed."""


class EngineVersionError(EngineError):
    """The engine speaks a vLLM version whose wire format we do not mirror."""


class EngineRequestError(EngineError):
    """The engine finished a request with an error (FinishReason.ERROR)."""


class EngineOverloadedError(EngineError):
    """Too much work queued: the client should retry later (429 or 503 with Retry-After)."""

    def __init__(self, message: str, *, status: int = 429, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
