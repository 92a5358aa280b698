"""Starting and stopping the built-in engine as a child process of its engine client."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..launcher.parent_death import dies_with_parent


def builtin_engine_command(
    handshake: str,
    *,
    max_model_len: int,
    max_num_seqs: int,
    step_interval_ms: float,
    step_us_per_sequence: float,
    step_us_per_prefill_token: float,
    model_dir: str | Path | None = None,
) -> list[str]:
    """The argv that starts a built-in engine process connecting to `handshake` (the sizes are the
    application's `builtin_engine.*` settings, whose defaults live in serve_app/config.py)."""
    cmd = [
        sys.executable, "-m", "mmserve.builtin_engine", "--handshake", handshake,
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--step-interval-ms", str(step_interval_ms),
        "--step-us-per-sequence", str(step_us_per_sequence),
        "--step-us-per-prefill-token", str(step_us_per_prefill_token),
    ]
    if model_dir is not None:
        cmd += ["--model-dir", str(model_dir)]
    return cmd


@dataclass
class BuiltinEngineProcess:
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    def start(
        cls,
        *,
        handshake: str,
        model_dir: Path,
        max_model_len: int,
        max_num_seqs: int,
        step_interval_ms: float,
        step_us_per_sequence: float,
        step_us_per_prefill_token: float,
    ) -> "BuiltinEngineProcess":
        cmd = builtin_engine_command(
            handshake, model_dir=model_dir, max_model_len=max_model_len, max_num_seqs=max_num_seqs, step_interval_ms=step_interval_ms,
            step_us_per_sequence=step_us_per_sequence, step_us_per_prefill_token=step_us_per_prefill_token,
        )
        # The engine gets SIGTERM when its engine client's process dies: a crashed replica never
        # leaves an orphan engine holding a connection.
        process = subprocess.Popen(dies_with_parent(cmd), env=os.environ.copy())
        return cls(process)

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
