"""The layout rules, read from the source (ast), so that they cannot regress quietly.

- Imports point one way: serve_app → deployments → mmserve packages → mmserve/wire. Nothing
  below imports anything above; among mmserve's packages only the edges in `MMSERVE_DEPENDS_ON`
  exist, and the engine client imports no mmserve package but the wire (and no third-party
  package but pyzmq, msgspec and numpy). Nothing imports vllm, torch or transformers.
- No module over 400 lines, no class over 250 lines.
- Every module opens with a docstring whose first line says what it holds.
- No measurement, benchmark reference or dated history in the production code: a comment says why,
  and numbers go stale with the next change (they live in `bench/RESULTS.md`).
- Every function, method and class is used by production code: code only tests call lives in
  the tests (decorated ones are registered by their decorator: routes, validators, handlers).

`UPWARD_IMPORTS` and `OVERSIZED` name exceptions, and are empty: an entry that no longer
applies fails the test too, so they cannot silently grow stale. `CALLED_FROM_OUTSIDE` names the
few methods that operators call, each with its reason.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = ("serve_app", "deployments", "mmserve")

# Tiers, top to bottom; a module may import its own tier or any tier below.
TIERS = {"serve_app": 3, "deployments": 2, "mmserve": 1}

# Which mmserve units (packages, or top-level modules) each may import; none may import itself
# transitively back. mmserve.wire mirrors vLLM and imports nothing of ours.
MMSERVE_DEPENDS_ON: dict[str, set[str]] = {
    "mmserve.wire": set(),
    "mmserve.tokenizer_files": set(),
    "mmserve.model_files": {"mmserve.tokenizer_files"},
    "mmserve.fetch": set(),
    "mmserve.vision": set(),
    "mmserve.engine": {"mmserve.wire"},
    "mmserve.text": {"mmserve.model_files", "mmserve.tokenizer_files"},
    "mmserve.multimodal": {"mmserve.wire", "mmserve.model_files", "mmserve.fetch", "mmserve.vision", "mmserve.text"},
    # xgrammar's native parts without its torch-importing package (the gateway's spec checks, the built-in engine's structured outputs).
    "mmserve.xgrammar_native": set(),
    "mmserve.builtin_engine": {"mmserve.wire", "mmserve.model_files", "mmserve.launcher", "mmserve.xgrammar_native"},
    "mmserve.launcher": set(),
    # A request's travel between the tiers: links, their messages, routing (images as `ImageBatchRequest`).
    "mmserve.transit": {"mmserve.wire", "mmserve.engine", "mmserve.multimodal"},
    "mmserve.openai": {
        "mmserve.wire", "mmserve.transit", "mmserve.engine", "mmserve.text", "mmserve.multimodal", "mmserve.vision",
        "mmserve.xgrammar_native",
    },
}

# The engine client's whole world outside the standard library.
ENGINE_THIRD_PARTY = {"zmq", "msgspec", "numpy"}
FORBIDDEN = {"vllm", "torch", "transformers"}

# Exceptions to the layer rule, (importing module, imported module): none. Keep it empty.
UPWARD_IMPORTS: set[tuple[str, str]] = set()

MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250
# Exceptions to the size limits, "path" or "path::Class": none (the module docstring's rule).
OVERSIZED: set[str] = set()


@dataclass(frozen=True)
class Module:
    name: str  # dotted
    path: Path
    tree: ast.Module
    lines: int

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def _modules() -> list[Module]:
    found = []
    for top in PRODUCTION:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            text = path.read_text()
            found.append(Module(".".join(parts), path, ast.parse(text), len(text.splitlines())))
    return found


MODULES = _modules()


def _imports(module: Module) -> set[str]:
    """Every module name imported anywhere in the file (function-level imports too), resolved."""
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    names = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            # `from package import module` names a module too.
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def _ours(name: str) -> str | None:
    """The production module (or package) `name` refers to, or None for anything else."""
    known = {m.name for m in MODULES}
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _unit(name: str) -> str:
    """The mmserve unit a module belongs to: its package under mmserve, or the top-level module."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "mmserve" and len(parts) > 1 else name


def _edges() -> set[tuple[str, str]]:
    edges = set()
    for module in MODULES:
        for imported in _imports(module):
            target = _ours(imported)
            if target is not None and target != module.name:
                edges.add((module.name, target))
    return edges


EDGES = _edges()


def test_the_source_is_read():
    # The rules below must be checking something: the modules and edges they reason about exist.
    assert {"serve_app.builder", "deployments.router", "mmserve.engine.client", "mmserve.wire.codec"} <= {m.name for m in MODULES}
    assert ("mmserve.engine.client", "mmserve.wire") in EDGES
    assert ("serve_app.builder", "deployments.ingress") in EDGES


def test_nothing_imports_a_higher_tier():
    upward = {(a, b) for a, b in EDGES if TIERS[a.split(".")[0]] < TIERS[b.split(".")[0]]}
    assert upward - UPWARD_IMPORTS == set(), "new imports from a lower tier to a higher one"
    assert UPWARD_IMPORTS - upward == set(), "fixed: remove these from UPWARD_IMPORTS"


def test_mmserve_units_import_only_what_they_may():
    units = {_unit(m.name) for m in MODULES if m.name.startswith("mmserve.")}
    assert units == set(MMSERVE_DEPENDS_ON), "a new mmserve unit needs its place in MMSERVE_DEPENDS_ON"
    wrong = sorted(
        (a, b) for a, b in EDGES
        if a.startswith("mmserve.") and b.startswith("mmserve")
        and _unit(a) != _unit(b) and _unit(b) not in MMSERVE_DEPENDS_ON[_unit(a)]
    )
    assert wrong == []
    assert not any(a == "mmserve" or b == "mmserve" for a, b in EDGES if a.startswith("mmserve"))


def test_mmserve_dependencies_have_no_cycle():
    done: set[str] = set()

    def visit(unit: str, path: tuple[str, ...]) -> None:
        assert unit not in path, f"import cycle: {' → '.join(path + (unit,))}"
        if unit not in done:
            for dependency in MMSERVE_DEPENDS_ON[unit]:
                visit(dependency, path + (unit,))
            done.add(unit)

    for unit in MMSERVE_DEPENDS_ON:
        visit(unit, ())


def test_engine_client_imports_only_the_wire_and_its_transport():
    engine = [m for m in MODULES if _unit(m.name) == "mmserve.engine"]
    assert engine
    for module in engine:
        third_party = {
            name.split(".")[0] for name in _imports(module)
            if _ours(name) is None and name.split(".")[0] not in sys.stdlib_module_names
        }
        assert third_party <= ENGINE_THIRD_PARTY, (module.rel, third_party)


def test_the_gateway_never_imports_vllm_torch_or_transformers():
    for module in MODULES:
        assert not {name.split(".")[0] for name in _imports(module)} & FORBIDDEN, module.rel


def _oversized() -> set[str]:
    found = set()
    for module in MODULES:
        if module.lines > MAX_MODULE_LINES:
            found.add(module.rel)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                found.add(f"{module.rel}::{node.name}")
    return found


def test_modules_and_classes_are_readable_in_one_sitting():
    found = _oversized()
    assert found - OVERSIZED == set(), f"over {MAX_MODULE_LINES} lines per module or {MAX_CLASS_LINES} per class"
    assert OVERSIZED - found == set(), "fixed: remove these from OVERSIZED"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.rel)
def test_each_module_says_what_it_holds(module):
    body = module.tree.body
    assert body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), "no module docstring"
    first_line = str(body[0].value.value).strip().splitlines()[0]
    assert len(first_line.split()) >= 3, f"the docstring's first line says too little: {first_line!r}"


# Methods called from outside the application's code (by operators, through a Serve handle).
CALLED_FROM_OUTSIDE = {
    "deployments/engine_client.py::launcher_status": "the launched engine's process tree and restarts, for operators",
    "deployments/engine_client.py::record_autoscaling_stats": "called by Ray Serve (an engine pool's custom autoscaling metric)",
    "deployments/replica_router.py::choose_replicas": "called by Ray Serve (the request-router API)",
    "deployments/preprocessor.py::record_autoscaling_stats": "called by Ray Serve (the preprocessor's custom autoscaling metric)",
}


def _names_used() -> set[str]:
    """Every name production code reads: identifiers, attributes, and words in strings (getattr, handles)."""
    used: set[str] = set()
    for module in MODULES:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.update(node.value.replace(".", " ").replace(":", " ").split())
    return used


# Dates, references to the benchmarks and their results, what was measured, timings and speed-ups.
MEASUREMENT = re.compile(
    r"\b20\d\d-\d\d-\d\d\b|bench/|RESULTS\.md|\bmeasured\b(?! the image)|\b\d[\d.]* ?(ms|µs|GB/s)\b|"
    r"\b\d[\d.]* ?[x×] (faster|slower|cheaper)\b|\d ?%(?!\()"
)


def test_no_measurements_or_history_in_the_code():
    found = [
        f"{module.rel}:{number}: {line.strip()}"
        for module in MODULES for number, line in enumerate(module.path.read_text().splitlines(), 1)
        if MEASUREMENT.search(line)
    ]
    assert found == [], "measurements or dated history in production code (they belong in bench/RESULTS.md):\n" + "\n".join(found)


def _sections(markdown: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", markdown, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bcommit [0-9a-f]{7}\b|\bmain at\b")


def test_readme_is_a_users_guide_with_its_numbers_in_one_table():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README is the front door: keep it under 250 lines (details in docs/)"
    sections = _sections(readme)
    assert "Performance" in sections and DATED.search(sections["Performance"]), "the performance table says when it was made"
    dated = [f"## {name}: {line.strip()}" for name, text in sections.items() if name != "Performance"
             for line in text.splitlines() if DATED.search(line) or MEASUREMENT.search(line) and "bench/" not in line]
    assert dated == [], "dated measurements belong in README's performance table or bench/RESULTS.md:\n" + "\n".join(dated)


def test_results_page_gives_each_benchmark_its_command_date_commit_and_machine():
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    assert len(results.splitlines()) <= 300, "bench/RESULTS.md holds today's numbers; history goes to bench/history/"
    machine = re.search(r"^The machine of every section below.*$", results, re.M)
    assert machine, "RESULTS names the machine its sections share"
    for name, text in _sections(results).items():
        if "|" not in text or name == "Diagnostic tools":
            continue
        assert "```" in text, f"{name}: no command"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{name}: no date"
        assert re.search(r"\bcommits? [0-9a-f]{7}|\b[0-9a-f]{7}\b", text), f"{name}: no commit"


def test_production_code_is_used_by_production_code():
    used = _names_used()
    unused = set()
    for module in MODULES:
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not node.name.startswith("__") and not node.decorator_list and node.name not in used:
                    unused.add(f"{module.rel}::{node.name}")
    assert unused - CALLED_FROM_OUTSIDE.keys() == set(), "used by tests only (or by nothing): move to the tests, or delete"
    assert CALLED_FROM_OUTSIDE.keys() - unused == set(), "used by production code now: remove from CALLED_FROM_OUTSIDE"


def test_the_suite_lists_in_conftest_name_tests_that_exist():
    """A renamed test left out of REFERENCE_TESTS runs in the gateway venv and fails there, far from the rename."""
    from tests.conftest import ALONE_TESTS, OWN_CLUSTER_TESTS, REFERENCE_TESTS

    for path in [*REFERENCE_TESTS, *ALONE_TESTS, *OWN_CLUSTER_TESTS]:
        assert (ROOT / path).is_file(), f"tests/conftest.py names {path}, which does not exist"
    for path, names in REFERENCE_TESTS.items():
        if names != "*":
            tree = ast.parse((ROOT / path).read_text())
            defined = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
            assert names <= defined, f"REFERENCE_TESTS names {sorted(names - defined)} in {path}, which has no such test"
