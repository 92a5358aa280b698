#!/usr/bin/env bash
# Install both venvs (idempotent, pinned) and run the whole test suite, real vLLM engine tests included,
# in two parts (see tests/conftest.py):
#   1. from the gateway venv .venv (README's quick start install + test tools; no vllm, torch or
#      transformers): every test but the `reference` ones. Every Serve application of the suite runs
#      here; real vLLM engines, vLLM's offline reference and the tiny-model builders are started as
#      processes of the reference venv.
#   2. from the reference venv .venv-ref: the `reference` tests, which call vLLM's or Hugging Face's own
#      functions in-process.
# The reference venv is installed first; the reference part (about 2.5 minutes of one core, in-process
# comparisons only) then starts at a lower priority (`nice`) and runs on while pip installs the gateway
# venv and the gateway part runs: that part's Serve and vLLM tests leave about a third of the two cores
# idle while they wait on engines and replicas, which the reference part takes, never the time of the
# gateway part's tests, some of which have time bounds. Both parts always run; the exit status is
# non-zero if either fails. Arguments go to both pytest runs (paths, -k, -x, --co ...; not -m, which
# selects the parts).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 VLLM_TARGET_DEVICE=cpu
export MMSERVE_REFERENCE_PYTHON=$PWD/.venv-ref/bin/python

run_part() {  # run_part NAME PYTHON MARKEXPR ARGS...; sets RC and PART_S (PART_NICE: run at that niceness)
    local name=$1 python=$2 markexpr=$3; shift 3
    echo "[test] part $name: ${PART_NICE:+nice -n $PART_NICE }$python -m pytest -m \"$markexpr\" $*"
    RC=0
    local start=$SECONDS
    ${PART_NICE:+nice -n "$PART_NICE"} "$python" -m pytest -p no:cacheprovider -m "$markexpr" "$@" || RC=$?
    PART_S=$((SECONDS - start))
    echo "[test] part $name: exit status $RC"
}
minutes() { printf "%d:%02d" $(($1 / 60)) $(($1 % 60)); }

bash scripts/setup.sh reference
REFERENCE_SETUP_S=$((SECONDS - START))
REFERENCE_LOG=$(mktemp)
trap 'rm -f "$REFERENCE_LOG" "$REFERENCE_LOG.status"' EXIT
# The reference part, at a lower priority, beside all that follows; its output is shown when it ends.
(
    PART_NICE=5 run_part reference .venv-ref/bin/python "reference" "$@"
    echo "$RC $PART_S" > "$REFERENCE_LOG.status"
) > "$REFERENCE_LOG" 2>&1 &
REFERENCE_PID=$!
START_GATEWAY_SETUP=$SECONDS
bash scripts/setup.sh gateway
GATEWAY_SETUP_S=$((SECONDS - START_GATEWAY_SETUP))
BEFORE_GATEWAY_S=$((SECONDS - START))

run_part gateway .venv/bin/python "not reference" "$@"; GATEWAY_RC=$RC; GATEWAY_S=$PART_S
wait "$REFERENCE_PID" || true
cat "$REFERENCE_LOG"
read -r REFERENCE_RC REFERENCE_S < "$REFERENCE_LOG.status" || { REFERENCE_RC=1; REFERENCE_S=0; }
echo "[test] time: reference venv $(minutes $REFERENCE_SETUP_S), then the gateway venv $(minutes $GATEWAY_SETUP_S)" \
    "($(minutes $BEFORE_GATEWAY_S) until the gateway part) and the gateway part $(minutes $GATEWAY_S), with the" \
    "reference part beside them from the reference venv on ($(minutes $REFERENCE_S)); all $(minutes $((SECONDS - START))) (m:ss)"

# Exit status 5 (nothing collected) is fine for one part when arguments chose tests of the other only.
if [ "$GATEWAY_RC" = 5 ] && [ "$REFERENCE_RC" != 5 ]; then GATEWAY_RC=0; fi
if [ "$REFERENCE_RC" = 5 ] && [ "$GATEWAY_RC" != 5 ]; then REFERENCE_RC=0; fi
echo "[test] gateway part: $GATEWAY_RC, reference part: $REFERENCE_RC"
[ "$GATEWAY_RC" = 0 ] && [ "$REFERENCE_RC" = 0 ]
