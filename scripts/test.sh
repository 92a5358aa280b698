#!/usr/bin/env bash
# Install both venvs (idempotent, pinned) and run the whole test suite, real vLLM engine tests included.
# The suite runs from the reference venv for now; the tests that check what a user installs
# (tests/test_quickstart.py, tests/deployments/test_fastapi_versions.py) build fresh gateway venvs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 VLLM_TARGET_DEVICE=cpu
exec .venv-ref/bin/python -m pytest -p no:cacheprovider "$@"
