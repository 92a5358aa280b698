"""One built-in engine process's settings (its command line) and the bundled model directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "model"


@dataclass(frozen=True)
class BuiltinEngineSettings:
    """One built-in engine process's settings (its command line)."""

    handshake_address: str
    model_dir: Path = DEFAULT_MODEL_DIR
    max_model_len: int = 4096
    max_num_seqs: int = 256
    step_interval_ms: float = 2.0
    dp_rank: int = 0
    block_size: int = 16
    min_answer_tokens: int = 8
    max_answer_tokens: int = 40
