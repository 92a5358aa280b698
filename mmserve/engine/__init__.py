"""Engine client: the front-end of one vLLM engine over the EngineCore ZMQ protocol."""

from .client import EngineClient, EngineClientConfig, EngineState
from .errors import EngineDeadError, EngineError, EngineNotReadyError, EngineOverloadedError, EngineRequestError, EngineVersionError
from .guard import InvalidRequestError, PromptAccepted, admit
from .transport import EngineAddresses

__all__ = [
    "EngineAddresses", "EngineClient", "EngineClientConfig", "EngineDeadError", "EngineError",
    "EngineNotReadyError", "EngineOverloadedError", "EngineRequestError", "InvalidRequestError", "PromptAccepted", "admit", "EngineState", "EngineVersionError",
]
