#!/usr/bin/env bash
# Install everything (idempotent) and run the whole test suite, real vLLM engine tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 VLLM_TARGET_DEVICE=cpu
exec python -m pytest -p no:cacheprovider "$@"
