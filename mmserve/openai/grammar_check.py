"""Structured-output specs parsed by the grammar compiler the engine runs (xgrammar), before sending,
as vLLM 0.32's front end parses them (`validate_xgrammar_grammar`): what it refuses, the engine
would fail on.

xgrammar's parser (`xgrammar.grammar`: `Grammar.from_regex`, `from_ebnf`, `from_lark`,
`from_json_schema`, `from_structural_tag`), loaded without torch (`mmserve/xgrammar_native.py`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from mmserve.xgrammar_native import XgrammarMissing, xgrammar_module

# vLLM's `VLLM_REGEX_COMPILATION_TIMEOUT_S` default: a regex whose automaton explodes is refused
# rather than left to hang the engine's grammar thread.
REGEX_TIMEOUT_S = 5.0

class GrammarRejected(ValueError):
    """xgrammar refused the spec; the message is its own."""


def _grammar_class() -> Any:
    return xgrammar_module("grammar").Grammar


def load_grammar_parser() -> None:
    """Load the parser now (at the ingress's start): a missing xgrammar stops the start, with how to
    install it, instead of failing the first structured request."""
    _grammar_class()


def _parse(method: str, spec: Any) -> None:
    try:
        getattr(_grammar_class(), method)(spec)
    except XgrammarMissing:
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
