"""`vllm serve MODEL --headless --data-parallel-address H --data-parallel-rpc-port P [--max-model-len N]
[--max-num-seqs N] ...` answered by mmserve's built-in engine: lets the engine launcher's tests run a real
engine process on the real wire in seconds (a vLLM CPU engine takes minutes on this machine). Unknown
flags are ignored; sizes not given are the application's built-in engine defaults."""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    # Run as a script by the launcher: the repository root (for tests.support) is two levels up.
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    from mmserve.builtin_engine.__main__ import main
    from tests.support.defaults import builtin_engine_options

    defaults = builtin_engine_options()
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["serve"])
    p.add_argument("model")
    p.add_argument("--headless", action="store_true", required=True)
    p.add_argument("--data-parallel-address", required=True)
    p.add_argument("--data-parallel-rpc-port", required=True)
    p.add_argument("--max-model-len", default=str(defaults.max_model_len))
    p.add_argument("--max-num-seqs", default=str(defaults.max_num_seqs))
    args, _ = p.parse_known_args()
    sys.exit(main([
        "--handshake", f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}",
        "--model-dir", args.model, "--max-model-len", args.max_model_len, "--max-num-seqs", args.max_num_seqs,
        "--step-interval-ms", str(defaults.step_interval_ms),
        "--step-us-per-sequence", str(defaults.step_us_per_sequence),
        "--step-us-per-prefill-token", str(defaults.step_us_per_prefill_token),
    ]))
