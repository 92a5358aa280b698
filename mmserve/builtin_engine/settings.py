"""One built-in engine process's settings (its command line) and the bundled model directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "model"


@dataclass(frozen=True)
class BuiltinEngineSettings:
    """One built-in engine process's settings (its command line)."""

    handshake_address: str
    # The application's `builtin_engine.*` settings (serve_app/config.py is their one home).
    max_model_len: int
    max_num_seqs: int
    # A step's modelled time (`step_time.StepTime`): fixed, per sequence, per prefilled prompt token.
    step_interval_ms: float
    step_us_per_sequence: float
    step_us_per_prefill_token: float
    model_dir: Path = DEFAULT_MODEL_DIR
    dp_rank: int = 0
    block_size: int = 16
    min_answer_tokens: int = 8
    max_answer_tokens: int = 40
