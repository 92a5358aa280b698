"""`mmserve.openai.grammar_check`: xgrammar's parser in the gateway venv, as README's quick start installs
it: the version vLLM 0.32 pins everywhere it is written, loaded without torch or transformers, its
refusals in its own words, and a clear stop when it is missing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mmserve import xgrammar_native
from mmserve.openai import grammar_check

REPO = Path(__file__).resolve().parents[2]


def _pin(text: str) -> str:
    return re.search(r"^xgrammar==([^\s]+)$", text, re.M).group(1)


def test_the_pinned_version_is_vllms_everywhere():
    assert _pin((REPO / "scripts/constraints/gateway.txt").read_text()) == xgrammar_native.XGRAMMAR_VERSION
    assert _pin((REPO / "scripts/constraints/reference.txt").read_text()) == xgrammar_native.XGRAMMAR_VERSION
    assert f"GATEWAY_XGRAMMAR=xgrammar=={xgrammar_native.XGRAMMAR_VERSION}\n" in (REPO / "scripts/lock.sh").read_text()
    import importlib.metadata

    assert importlib.metadata.version("xgrammar") == xgrammar_native.XGRAMMAR_VERSION


def test_loading_the_parser_imports_no_torch_transformers_or_xgrammar_package():
    code = (
        "import sys; from mmserve.openai import grammar_check as g; g.load_grammar_parser(); g.check_ebnf('root ::= \"a\"'); "
        "print(sorted(m for m in ('torch', 'transformers', 'triton', 'xgrammar') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stderr


def test_refusals_are_the_compilers_reason_without_its_source_location():
    with pytest.raises(grammar_check.GrammarRejected) as refused:
        grammar_check.check_ebnf("root ::= b")
    assert str(refused.value) == 'EBNF parser error at line 1, column 10: Rule "b" is not defined'
    with pytest.raises(grammar_check.GrammarRejected, match="Lookahead is not supported"):
        grammar_check.check_regex("(?=a)b")
    grammar_check.check_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})


def test_a_missing_xgrammar_stops_the_start_with_how_to_install_it(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xgrammar" else real_find_spec(name, *a))
    monkeypatch.delitem(sys.modules, "xgrammar", raising=False)
    monkeypatch.delitem(sys.modules, "_mmserve_xgrammar", raising=False)
    xgrammar_native.xgrammar_module.cache_clear()
    try:
        with pytest.raises(xgrammar_native.XgrammarMissing, match="pip install --no-deps xgrammar==0.2.8"):
            grammar_check.load_grammar_parser()
    finally:
        xgrammar_native.xgrammar_module.cache_clear()
