#!/usr/bin/env bash
# Install both venvs (idempotent, pinned) and run the whole test suite, real vLLM engine tests included,
# in two parts (see tests/conftest.py):
#   1. from the gateway venv .venv (README's quick start install + test tools; no vllm, torch or
#      transformers): every test but the `reference` ones. Every Serve application of the suite runs
#      here; real vLLM engines, vLLM's offline reference and the tiny-model builders are started as
#      processes of the reference venv.
#   2. from the reference venv .venv-ref: the `reference` tests, which call vLLM's or Hugging Face's own
#      functions in-process.
# Both parts always run; the exit status is non-zero if either fails. Arguments go to both pytest runs
# (paths, -k, -x, --co ...; not -m, which selects the parts).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
bash scripts/setup.sh
SETUP_S=$((SECONDS - START))
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 VLLM_TARGET_DEVICE=cpu
export MMSERVE_REFERENCE_PYTHON=$PWD/.venv-ref/bin/python

run_part() {  # run_part NAME PYTHON MARKEXPR ARGS...; sets RC
    local name=$1 python=$2 markexpr=$3; shift 3
    echo "[test] part $name: $python -m pytest -m \"$markexpr\" $*"
    RC=0
    local start=$SECONDS
    "$python" -m pytest -p no:cacheprovider -m "$markexpr" "$@" || RC=$?
    PART_S=$((SECONDS - start))
    echo "[test] part $name: exit status $RC"
}
run_part gateway .venv/bin/python "not reference" "$@"; GATEWAY_RC=$RC; GATEWAY_S=$PART_S
run_part reference .venv-ref/bin/python "reference" "$@"; REFERENCE_RC=$RC; REFERENCE_S=$PART_S
minutes() { printf "%d:%02d" $(($1 / 60)) $(($1 % 60)); }
echo "[test] time: setup $(minutes $SETUP_S), gateway part $(minutes $GATEWAY_S), reference part $(minutes $REFERENCE_S), all $(minutes $((SECONDS - START))) (m:ss)"

# Exit status 5 (nothing collected) is fine for one part when arguments chose tests of the other only.
if [ "$GATEWAY_RC" = 5 ] && [ "$REFERENCE_RC" != 5 ]; then GATEWAY_RC=0; fi
if [ "$REFERENCE_RC" = 5 ] && [ "$GATEWAY_RC" != 5 ]; then REFERENCE_RC=0; fi
echo "[test] gateway part: $GATEWAY_RC, reference part: $REFERENCE_RC"
[ "$GATEWAY_RC" = 0 ] && [ "$REFERENCE_RC" = 0 ]
