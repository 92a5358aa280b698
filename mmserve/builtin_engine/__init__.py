"""mmserve's built-in engine: a deterministic stand-in for a headless vLLM 0.32 engine.

Runs as its own process (`python -m mmserve.builtin_engine --handshake tcp://HOST:PORT`) and
speaks the EngineCore ZMQ wire, so the gateway works end to end without a GPU or vLLM.
It is not a model: answers are readable-ish words drawn deterministically from the prompt.
"""

from __future__ import annotations

from .engine import BuiltinEngine
from .launcher import builtin_engine_command
from .settings import DEFAULT_MODEL_DIR, BuiltinEngineSettings
from .handshake import VLLM_VERSION

__all__ = ["DEFAULT_MODEL_DIR", "VLLM_VERSION", "BuiltinEngine", "BuiltinEngineSettings", "builtin_engine_command"]
