#!/usr/bin/env bash
# Install both venvs (idempotent, pinned) and run the whole test suite, real vLLM engine tests included,
# in three pytest processes at once (see tests/conftest.py):
#   1. the gateway part, from the gateway venv .venv (README's quick start install + test tools; no vllm,
#      torch or transformers): every test but the `reference` and `own_cluster` ones, on one Ray instance
#      whose Serve applications the tests share; real vLLM engines, vLLM's offline reference and the
#      tiny-model builders are processes of the reference venv (forked from one warm vLLM zygote).
#   2. the own-cluster part, from .venv too: the tests that run on Ray clusters of their own (README's
#      quick start in a fresh clone, `serve run`, a multi-node cluster, the engine launcher's on this
#      process's own instance), beside the gateway part, whose tests with tight time bounds wait until
#      this part has ended.
#   3. the reference part, from the reference venv .venv-ref: the `reference` tests, which call vLLM's
#      or Hugging Face's own functions in-process; at the lowest priority (`nice -n 19`), so that it
#      takes the cores the others leave idle while they wait on engines and replicas, never their time.
#   4. then, once those have ended, the alone part: own-cluster tests too heavy to share the machine
#      (a `ray start` cluster of real vLLM engines; tests/conftest.py ALONE_TESTS).
# The two venvs are installed at the same time (uv for the reference venv, pip for the gateway venv:
# mostly unpacking and writing files); the reference part starts when its venv is ready, the gateway
# parts when both are (their real engines run from the reference venv). All parts always run; the exit
# status is non-zero if any fails. Arguments go to every pytest run (paths, -k, -x, --co ...; not -m,
# which selects the parts).
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

REFERENCE_LOG=$(mktemp)
# The reference venv, then the reference part at a lower priority, beside all that follows; its output
# is shown when it ends. "$REFERENCE_LOG.ready" holds the venv's set-up time (or "failed").
(
    start=$SECONDS
    if bash scripts/setup.sh reference; then
        echo $((SECONDS - start)) > "$REFERENCE_LOG.ready"
    else
        echo failed > "$REFERENCE_LOG.ready"
        exit 1
    fi
    PART_NICE=19 run_part reference .venv-ref/bin/python "reference" "$@"
    echo "$RC $PART_S" > "$REFERENCE_LOG.status"
) > "$REFERENCE_LOG" 2>&1 &
REFERENCE_PID=$!
# On an early exit (the gateway venv failed to install): stop the reference side too.
trap 'pkill -P "$REFERENCE_PID" 2>/dev/null || true; kill "$REFERENCE_PID" 2>/dev/null || true
      rm -f "$REFERENCE_LOG" "$REFERENCE_LOG.ready" "$REFERENCE_LOG.status"' EXIT
bash scripts/setup.sh gateway
GATEWAY_SETUP_S=$((SECONDS - START))
while [ ! -s "$REFERENCE_LOG.ready" ] && kill -0 "$REFERENCE_PID" 2>/dev/null; do sleep 1; done
read -r REFERENCE_SETUP_S < "$REFERENCE_LOG.ready" || REFERENCE_SETUP_S=failed
if [ "$REFERENCE_SETUP_S" = failed ]; then
    wait "$REFERENCE_PID" || true
    cat "$REFERENCE_LOG"
    echo "[test] the reference venv could not be installed"
    exit 1
fi
BEFORE_GATEWAY_S=$((SECONDS - START))

# The gateway tests in two processes at once: those that run on Ray clusters of their own (README's
# quick start, `serve run`, a multi-node cluster, the launcher's; tests/conftest.py OWN_CLUSTER_TESTS)
# beside the others, whose tests with tight time bounds wait until the own-cluster process has ended.
OWN_CLUSTER_LOG=$(mktemp)
export MMSERVE_OWN_CLUSTER_PART_DONE=$OWN_CLUSTER_LOG.done
(
    done_file=$MMSERVE_OWN_CLUSTER_PART_DONE
    unset MMSERVE_OWN_CLUSTER_PART_DONE  # this part never waits for itself
    run_part own-cluster .venv/bin/python "not reference and own_cluster and not alone" "$@"
    echo "$RC $PART_S" > "$OWN_CLUSTER_LOG.status"
    touch "$done_file"
) > "$OWN_CLUSTER_LOG" 2>&1 &
OWN_CLUSTER_PID=$!
run_part gateway .venv/bin/python "not reference and not own_cluster" "$@"; GATEWAY_RC=$RC; GATEWAY_S=$PART_S
wait "$OWN_CLUSTER_PID" || true
cat "$OWN_CLUSTER_LOG"
read -r OWN_CLUSTER_RC OWN_CLUSTER_S < "$OWN_CLUSTER_LOG.status" || { OWN_CLUSTER_RC=1; OWN_CLUSTER_S=0; }
rm -f "$OWN_CLUSTER_LOG" "$OWN_CLUSTER_LOG.status" "$MMSERVE_OWN_CLUSTER_PART_DONE"
wait "$REFERENCE_PID" || true
cat "$REFERENCE_LOG"
read -r REFERENCE_RC REFERENCE_S < "$REFERENCE_LOG.status" || { REFERENCE_RC=1; REFERENCE_S=0; }
# Last, with the machine to itself: the own-cluster tests too heavy to share it (tests/conftest.py ALONE_TESTS).
run_part alone .venv/bin/python "not reference and alone" "$@"; ALONE_RC=$RC; ALONE_S=$PART_S
echo "[test] time: the reference venv $(minutes $REFERENCE_SETUP_S) and the gateway venv $(minutes $GATEWAY_SETUP_S)," \
    "installed at once ($(minutes $BEFORE_GATEWAY_S) until the gateway parts); the gateway part $(minutes $GATEWAY_S)," \
    "with the own-cluster part ($(minutes $OWN_CLUSTER_S)) and the reference part ($(minutes $REFERENCE_S), from" \
    "the reference venv on) beside it, then the alone part ($(minutes $ALONE_S)); all $(minutes $((SECONDS - START))) (m:ss)"

# Exit status 5 (nothing collected) is fine for a part when arguments chose tests of the others only.
echo "[test] gateway part: $GATEWAY_RC, own-cluster part: $OWN_CLUSTER_RC, reference part: $REFERENCE_RC, alone part: $ALONE_RC"
FAILED=0 ALL_EMPTY=1
for rc in "$GATEWAY_RC" "$OWN_CLUSTER_RC" "$REFERENCE_RC" "$ALONE_RC"; do
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || FAILED=1
    [ "$rc" = 5 ] || ALL_EMPTY=0
done
[ "$FAILED" = 0 ] && [ "$ALL_EMPTY" = 0 ]
