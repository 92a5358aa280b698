"""xgrammar, the grammar compiler vLLM's engines run, without its package `__init__`.

Its parser (`xgrammar.grammar`) and its native compiler and matcher (`xgrammar.base._core`) need only
its native library, tvm-ffi and pydantic; its package `__init__` also imports its token-mask and
tokenizer helpers, which import torch and transformers. So the gateway installs xgrammar without its
dependencies (README's quick start) and loads the modules it uses under a package of its own
(`_mmserve_xgrammar`) whose `__init__` never runs: `import xgrammar` is never executed, and torch is
never imported. Used by the ingress's spec checks (`mmserve/openai/grammar_check.py`) and the built-in
engine's structured outputs (`mmserve/builtin_engine/structured.py`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import re
import sys
import types
from typing import Any

# The version vLLM 0.32 pins (`xgrammar==0.2.8`); the handshake checks the engine's vLLM version.
XGRAMMAR_VERSION = "0.2.8"
INSTALL_HINT = f"pip install --no-deps xgrammar=={XGRAMMAR_VERSION} (README's quick start does)"

_ALIAS = "_mmserve_xgrammar"
logger = logging.getLogger("ray.serve")


class XgrammarMissing(RuntimeError):
    """xgrammar is not installed in this environment."""


@functools.cache
def xgrammar_module(name: str) -> Any:
    """`xgrammar.<name>`, its package `__init__` skipped. If the real package is already imported (a
    process that also runs vLLM: the tests' reference venv), its module is used, as loading the native
    library's types twice is refused."""
    if (loaded := sys.modules.get("xgrammar")) is not None and hasattr(loaded, "Grammar"):
        return importlib.import_module(f"xgrammar.{name}")
    if _ALIAS not in sys.modules:
        spec = importlib.util.find_spec("xgrammar")
        if spec is None or not spec.submodule_search_locations:
            raise XgrammarMissing(f"xgrammar is not installed: {INSTALL_HINT}")
        package = types.ModuleType(_ALIAS)
        package.__path__ = list(spec.submodule_search_locations)
        package.__package__ = _ALIAS
        sys.modules[_ALIAS] = package
        # The order of xgrammar's own `__init__`: the native library, its error types, then the rest.
        importlib.import_module(f"{_ALIAS}.load_binding")
        importlib.import_module(f"{_ALIAS}.exception")
        installed = importlib.metadata.version("xgrammar")
        if installed != XGRAMMAR_VERSION:
            logger.warning(
                "xgrammar %s is installed, vLLM 0.32's engines run %s: specs may be judged differently "
                "from the engine (%s)", installed, XGRAMMAR_VERSION, INSTALL_HINT,
            )
    return importlib.import_module(f"{_ALIAS}.{name}")


def is_lark(grammar: str) -> bool:
    """vLLM's `grammar_is_likely_lark`: no line (comments removed) defines an EBNF rule (`::=`)."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))
