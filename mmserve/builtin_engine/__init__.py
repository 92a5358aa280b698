"""mmserve's built-in engine: a deterministic stand-in for a headless vLLM 0.32 engine.

Runs as its own process (`python -m mmserve.builtin_engine --handshake tcp://HOST:PORT`) and
speaks the EngineCore ZMQ wire, so the gateway works end to end without a GPU or vLLM.
It is not a model: answers are readable-ish words drawn deterministically from the prompt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .engine import BuiltinEngine
from .settings import DEFAULT_MODEL_DIR, BuiltinEngineSettings
from .handshake import VLLM_VERSION

__all__ = ["DEFAULT_MODEL_DIR", "VLLM_VERSION", "BuiltinEngine", "BuiltinEngineSettings", "builtin_engine_command"]


def builtin_engine_command(
    handshake: str,
    *,
    model_dir: str | Path | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    step_interval_ms: float | None = None,
    dp_rank: int | None = None,
    python: str | None = None,
) -> list[str]:
    """The argv that starts a built-in engine process connecting to `handshake`."""
    cmd = [python or sys.executable, "-m", "mmserve.builtin_engine", "--handshake", handshake]
    for flag, value in (
        ("--model-dir", model_dir),
        ("--max-model-len", max_model_len),
        ("--max-num-seqs", max_num_seqs),
        ("--step-interval-ms", step_interval_ms),
        ("--dp-rank", dp_rank),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd
