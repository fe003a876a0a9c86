"""The code's layout rules: the import contracts (import-linter), no import circle between any two
modules, the three parts of ``inference/``, and the size of a module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
# The project's packages (what a wheel of it carries), and the tests beside them.
PACKAGES = ("inference", "gateway", "api", "chat", "dashboard", "tenants", "llm_platform",
            "benchmarks")
# Packages whose modules stay readable in one sitting.
SIZE_CHECKED = ("inference", "gateway", "api", "chat", "benchmarks")
MAX_MODULE_LINES = 400


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """Every import of the project's modules and the tests', those under ``TYPE_CHECKING`` and
    inside functions included."""
    return grimp.build_graph(*PACKAGES, "tests", include_external_packages=False,
                             exclude_type_checking_imports=False, cache_dir=None)


def circles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module among ``modules``: each is a
    set of modules every one of which imports every other, directly or through the others
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(
                        graph.find_modules_directly_imported_by(nxt) & modules))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_import_contracts_hold():
    result = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("package", PACKAGES)
def test_no_two_modules_import_each_other(graph, package):
    modules = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    assert circles(graph, modules) == []


def test_the_circle_finder_finds_a_circle_through_a_function_level_import():
    made = grimp.ImportGraph()
    for name in ("a", "a.one", "a.two", "a.three"):
        made.add_module(name)
    made.add_import(importer="a.one", imported="a.two")
    made.add_import(importer="a.two", imported="a.three")
    made.add_import(importer="a.three", imported="a.one")
    assert circles(made, {"a.one", "a.two", "a.three"}) == [["a.one", "a.three", "a.two"]]
    made.remove_import(importer="a.three", imported="a.one")
    assert circles(made, {"a.one", "a.two", "a.three"}) == []


def test_the_graph_counts_imports_inside_functions_and_under_type_checking(graph):
    # inference.engine.backends imports its backends inside load_backend(), the engine's
    # modules their types under TYPE_CHECKING: both are in the graph the circle test reads.
    imported = graph.find_modules_directly_imported_by("inference.engine.backends")
    assert "inference.engine.backends.reference" in imported


def test_no_packaged_module_imports_the_tests(graph):
    offenders = {(m, t) for m in graph.modules if m.split(".")[0] in PACKAGES
                 for t in graph.find_modules_directly_imported_by(m) if t.split(".")[0] == "tests"}
    assert offenders == set()


def test_inference_shows_its_three_parts():
    parts = {p.name for p in (REPO / "inference").iterdir() if p.name != "__pycache__"}
    assert parts == {"__init__.py", "engine", "worker", "protocol", "tokenization"}


@pytest.mark.parametrize("package", SIZE_CHECKED)
def test_no_module_is_longer_than_one_sitting(package):
    long = {str(p.relative_to(REPO)): n for p in (REPO / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these along their concepts: {long}"
