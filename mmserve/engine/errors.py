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
