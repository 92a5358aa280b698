"""`python -m mmserve.builtin_engine --handshake tcp://127.0.0.1:PORT [...]`

Starts mmserve's built-in engine (a deterministic stand-in for `vllm serve --headless`, not a
real model) and connects it to a front-end's handshake ROUTER, exactly as a headless vLLM 0.32
engine started with `--data-parallel-address HOST --data-parallel-rpc-port PORT` would.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from .engine import BuiltinEngine
from .settings import DEFAULT_MODEL_DIR, BuiltinEngineSettings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mmserve.builtin_engine",
        description="mmserve built-in engine: speaks vLLM 0.32's EngineCore wire; deterministic, not a real model.",
    )
    p.add_argument("--handshake", required=True, help="the front-end's handshake ROUTER, tcp://HOST:PORT")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                   help="directory with tokenizer.json and config.json (default: the bundled tiny Qwen2-VL)")
    # Required: the application passes its `builtin_engine.*` settings (defaults: serve_app/config.py).
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--step-interval-ms", type=float, required=True, help="a step's fixed time, ms")
    p.add_argument("--step-us-per-sequence", type=float, required=True, help="a step's time per sequence in its batch, µs")
    p.add_argument("--step-us-per-prefill-token", type=float, required=True, help="a step's time per prompt token it prefills, µs")
    p.add_argument("--dp-rank", type=int, default=0, help="data-parallel rank (the DEALER identity)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if not args.handshake.startswith("tcp://"):
        p.error("--handshake must be tcp://HOST:PORT")
    if args.max_model_len < 2 or args.max_num_seqs < 1:
        p.error("--max-model-len >= 2 and --max-num-seqs >= 1 are required")
    if min(args.step_interval_ms, args.step_us_per_sequence, args.step_us_per_prefill_token) < 0:
        p.error("step times must not be negative")
    if not 0 <= args.dp_rank < 65536:
        p.error("--dp-rank must fit in 2 bytes")
    return args


def main(argv: list[str] | None = None, engine_class: type[BuiltinEngine] = BuiltinEngine) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s [builtin-engine pid=%(process)d] %(message)s",
    )
    engine = engine_class(
        BuiltinEngineSettings(
            handshake_address=args.handshake,
            model_dir=args.model_dir,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            step_interval_ms=args.step_interval_ms,
            step_us_per_sequence=args.step_us_per_sequence,
            step_us_per_prefill_token=args.step_us_per_prefill_token,
            dp_rank=args.dp_rank,
        )
    )

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("mmserve.builtin_engine").info("received %s", signal.Signals(signum).name)
        engine.request_shutdown()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return engine.run()


if __name__ == "__main__":
    sys.exit(main())
