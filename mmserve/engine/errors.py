"""Errors an engine client raises to its callers (the layer above maps them to HTTP)."""


class EngineError(Exception):
    """Base class: the request could not be served by this engine."""


class EngineNotReadyError(EngineError):
    """The engine has not completed its handshake yet (or never will)."""


class EngineDeadError(EngineError):
    """The engine died, hung or went away; every open request on it has failed."""


class EngineVersionError(EngineError):
    """The engine speaks a vLLM version whose wire format we do not mirror."""


class EngineOverloadedError(EngineError):
    """This engine has too many requests in flight: the caller should retry after `retry_after_s`."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
