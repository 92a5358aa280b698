"""The engine client stands alone: importing it loads neither the image nor the text stack."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("PIL", "jinja2", "tokenizers", "mmserve.multimodal", "mmserve.text", "mmserve.vision")


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys\n{statement}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return result.stdout.split()


def test_engine_package_loads_no_image_or_text_stack():
    assert _loaded_after("import mmserve.engine") == []


def test_engine_client_loads_no_image_or_text_stack():
    assert _loaded_after("from mmserve.engine.client import EngineClient") == []


def test_the_check_can_fail():
    # The same probe sees the stack when it is loaded, so an empty answer above means something.
    assert "PIL" in _loaded_after("import mmserve.multimodal")
