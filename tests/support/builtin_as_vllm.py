"""`vllm serve MODEL --headless --data-parallel-address H --data-parallel-rpc-port P [--max-model-len N] ...`
answered by mmserve's built-in engine: lets the engine launcher's tests run a real engine process on the
real wire in seconds (a vLLM CPU engine takes minutes on this machine). Unknown flags are ignored."""

from __future__ import annotations

import argparse
import sys

from mmserve.builtin_engine.__main__ import main

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["serve"])
    p.add_argument("model")
    p.add_argument("--headless", action="store_true", required=True)
    p.add_argument("--data-parallel-address", required=True)
    p.add_argument("--data-parallel-rpc-port", required=True)
    p.add_argument("--max-model-len", default="4096")
    args, _ = p.parse_known_args()
    sys.exit(main([
        "--handshake", f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}",
        "--model-dir", args.model, "--max-model-len", args.max_model_len,
    ]))
