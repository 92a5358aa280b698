"""Structured-output specs parsed by the grammar compiler the engine runs (xgrammar), before sending,
as vLLM 0.32's front end parses them (`validate_xgrammar_grammar`): what it refuses, the engine
would fail on.

xgrammar's parser (`xgrammar.grammar`: `Grammar.from_regex`, `from_ebnf`, `from_lark`,
`from_json_schema`, `from_structural_tag`) needs only its native library, tvm-ffi and pydantic; its
package `__init__` also imports the token-mask and tokenizer parts, which import torch and
transformers. So the gateway installs xgrammar without its dependencies (README's quick start) and
loads the parser's modules under a package of its own (`_mmserve_xgrammar`) whose `__init__` never
runs: `import xgrammar` is never executed here, and torch is never imported.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

# The version vLLM 0.32 pins (`xgrammar==0.2.8`); the handshake checks the engine's vLLM version.
XGRAMMAR_VERSION = "0.2.8"
INSTALL_HINT = f"pip install --no-deps xgrammar=={XGRAMMAR_VERSION} (README's quick start does)"
# vLLM's `VLLM_REGEX_COMPILATION_TIMEOUT_S` default: a regex whose automaton explodes is refused
# rather than left to hang the engine's grammar thread.
REGEX_TIMEOUT_S = 5.0

_ALIAS = "_mmserve_xgrammar"
logger = logging.getLogger("ray.serve")


class GrammarRejected(ValueError):
    """xgrammar refused the spec; the message is its own."""


class GrammarParserMissing(RuntimeError):
    """xgrammar is not installed in this environment."""


@functools.cache
def _grammar_class() -> Any:
    """xgrammar's `Grammar` class, its package `__init__` skipped (see the module docstring). If the
    real package is already imported (a process that also runs vLLM: the tests' reference venv),
    that one is used, as loading the native library's types twice is refused."""
    if (loaded := sys.modules.get("xgrammar")) is not None and hasattr(loaded, "Grammar"):
        return loaded.Grammar
    spec = importlib.util.find_spec("xgrammar")
    if spec is None or not spec.submodule_search_locations:
        raise GrammarParserMissing(f"xgrammar is not installed: {INSTALL_HINT}")
    package = types.ModuleType(_ALIAS)
    package.__path__ = list(spec.submodule_search_locations)
    package.__package__ = _ALIAS
    sys.modules[_ALIAS] = package
    # The order of xgrammar's own `__init__`: the native library, its error types, then the parser.
    importlib.import_module(f"{_ALIAS}.load_binding")
    importlib.import_module(f"{_ALIAS}.exception")
    installed = importlib.metadata.version("xgrammar")
    if installed != XGRAMMAR_VERSION:
        logger.warning(
            "xgrammar %s is installed, vLLM 0.32's engines run %s: specs may be judged differently "
            "from the engine (%s)", installed, XGRAMMAR_VERSION, INSTALL_HINT,
        )
    return importlib.import_module(f"{_ALIAS}.grammar").Grammar


def load_grammar_parser() -> None:
    """Load the parser now (at the ingress's start): a missing xgrammar stops the start, with how to
    install it, instead of failing the first structured request."""
    _grammar_class()


def _parse(method: str, spec: Any) -> None:
    try:
        getattr(_grammar_class(), method)(spec)
    except GrammarParserMissing:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (native) or ValueError/pydantic errors
        raise GrammarRejected(_first_line(exc)) from None


def _first_line(exc: BaseException) -> str:
    """xgrammar's native messages start with a timestamp and a source path; the reason follows."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    _, sep, reason = text.partition(": ")
    return reason if sep and text.startswith("[") else text


def check_regex(pattern: str) -> None:
    """`Grammar.from_regex`, with vLLM's compilation timeout."""
    _grammar_class()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmserve-regex")
    future = executor.submit(_parse, "from_regex", pattern)
    try:
        future.result(timeout=REGEX_TIMEOUT_S)
    except FutureTimeout:
        raise GrammarRejected(
            f"compiling it took longer than {REGEX_TIMEOUT_S:g} s; the pattern may be too complex"
        ) from None
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def check_ebnf(grammar: str) -> None:
    _parse("from_ebnf", grammar)


def check_lark(grammar: str) -> None:
    _parse("from_lark", grammar)


def check_json_schema(schema: str | dict | bool) -> None:
    _parse("from_json_schema", schema)


def check_structural_tag(tag: str) -> None:
    _parse("from_structural_tag", tag)
