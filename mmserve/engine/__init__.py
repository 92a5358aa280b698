"""Engine client: the front-end of one vLLM engine over the EngineCore ZMQ protocol.

Imports only `mmserve.wire` (plus pyzmq, msgspec, numpy): no image or text stack.
"""

from .client import EngineClient, EngineState
from .config import EngineClientConfig
from .errors import EngineDeadError, EngineError, EngineNotReadyError, EngineOverloadedError, EngineVersionError
from .guard import InvalidRequestError, admit, context_exceeded, fit_max_tokens
from .transport import EngineAddresses

__all__ = [
    "EngineAddresses", "EngineClient", "EngineClientConfig", "EngineDeadError", "EngineError",
    "EngineNotReadyError", "EngineOverloadedError", "EngineState", "EngineVersionError", "InvalidRequestError", "admit",
    "context_exceeded", "fit_max_tokens",
]
