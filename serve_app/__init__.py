"""mmserve's Ray Serve application: `serve run serve_app:app` (built-in engine) or
`serve run serve_app:build_app model=DIR engines=tcp://HOST:PORT` (vLLM headless engines); engines
added and removed while serving: `serve_app:build_engine_app`, one Serve application each."""

from .builder import build_app, build_engine_app
from .config import AppConfig, BuiltinEngineConfig, EngineEndpoint, LimitsConfig

__all__ = ["AppConfig", "BuiltinEngineConfig", "EngineEndpoint", "LimitsConfig", "app", "build_app", "build_engine_app"]


def __getattr__(name: str):
    # `serve run serve_app:app` builds the default application on first access only.
    if name == "app":
        return build_app({})
    raise AttributeError(name)
