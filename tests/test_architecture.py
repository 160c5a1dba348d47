"""The tree, docs/architecture.md and the imports say the same thing.

Walks every module of autopar and cost_models with `ast` and collects its imports of the
project's own modules: at module level and inside functions (a call-time import is a
dependency too), but not those under `if TYPE_CHECKING:`, which only annotate. Then:

- every module of autopar lies in a package of `LAYERS`, or is one of the driver's few
  top-level modules;
- a module imports only its own layer and the layers before it (`LAYERS` is the order:
  each phase may use what comes before it, never what comes after);
- the packages' import graph has no cycle;
- the one call back up is `Plan.plot` / `Plan.save` calling the driver (`CALLBACKS`);
- docs/architecture.md lists the same layers in the same order;
- no source file is over 600 lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]

# Lowest first. A name is a package of autopar (autopar.hardware), a module (autopar.errors)
# or a top-level package of this repository (cost_models).
LAYERS = (
    "autopar.errors",
    "cost_models",
    "autopar.hardware",
    "autopar.config",
    "autopar.models",
    "autopar.tracing",
    "autopar.estimate",
    "autopar.solve",
    "autopar.plan",
    "autopar.runtime",
    "autopar.codegen",
    "autopar.api",
    "autopar.profiler",
    "autopar.cli",
    "autopar",  # the package root: the public names, lazily; and `python -m autopar`
)
TOP_LEVEL_MODULES = {"autopar", "autopar.__main__", "autopar.api", "autopar.errors"}
# (importer module, imported module): the only imports that go up the layers, at call time.
CALLBACKS = {("autopar.plan.types", "autopar.api")}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for root in ("autopar", "cost_models"):
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """(imported module, line, at call time) for each import outside TYPE_CHECKING blocks."""

    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.module, self.is_package, self.known = module, is_package, known
        self.depth = 0
        self.found: list[tuple[str, int, bool]] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.module.split(".")
            if not self.is_package:
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, *([node.module] if node.module else [])])
        for alias in node.names:  # `from autopar.models import zoo` imports a module
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.known else base, node.lineno)

    def _add(self, name: str, line: int) -> None:
        if name.split(".")[0] in ("autopar", "cost_models"):
            self.found.append((name, line, self.depth > 0))


def _imports() -> dict[str, list[tuple[str, int, bool]]]:
    modules = _modules()
    known = set(modules)
    out = {}
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        out[name] = visitor.found
    return out


def layer_of(module: str) -> str:
    """The entry of `LAYERS` a module belongs to: the longest that is it or contains it."""
    for layer in sorted(LAYERS, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    raise AssertionError(f"{module} lies in no layer of {LAYERS}")


def test_every_module_lies_in_a_layer_package() -> None:
    loose = [
        m
        for m, path in _modules().items()
        if path.parent == REPO / "autopar" and path.name != "__init__.py"
        if m not in TOP_LEVEL_MODULES
    ]
    assert not loose, f"modules at the top of autopar/, outside any phase package: {loose}"
    packages = {
        f"autopar.{p.name}"
        for p in (REPO / "autopar").iterdir()
        if p.is_dir() and (p / "__init__.py").is_file()
    }
    assert packages <= set(LAYERS), f"packages not in LAYERS: {sorted(packages - set(LAYERS))}"
    assert {m for m in LAYERS if m.startswith("autopar.")} - TOP_LEVEL_MODULES == packages


def test_no_phase_imports_a_later_one() -> None:
    order = {layer: i for i, layer in enumerate(LAYERS)}
    wrong = []
    for module, found in _imports().items():
        here = order[layer_of(module)]
        for target, line, call_time in found:
            there = order[layer_of(target)]
            if there <= here or (call_time and (module, target) in CALLBACKS):
                continue
            wrong.append(f"{module}:{line} imports {target} ({layer_of(target)} comes after)")
    assert not wrong, "\n".join(wrong)


def test_callbacks_are_call_time_only() -> None:
    for module, found in _imports().items():
        for target, line, call_time in found:
            if (module, target) in CALLBACKS:
                assert call_time, f"{module}:{line} imports {target} at load time"


def test_packages_have_no_import_cycle() -> None:
    graph = nx.DiGraph()
    for module, found in _imports().items():
        for target, _, _ in found:
            a, b = layer_of(module), layer_of(target)
            if a != b and (module, target) not in CALLBACKS:
                graph.add_edge(a, b)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles between packages: {cycles}"


def test_the_layering_check_catches_a_backward_import(tmp_path: Path) -> None:
    """The visitor sees a function-level import, and skips a TYPE_CHECKING one."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from autopar.api import plot\n"
        "def f():\n    from autopar.codegen import generate\n"
    )
    visitor = _Imports("autopar.estimate.x", False, set(_modules()))
    visitor.visit(ast.parse(source))
    assert visitor.found == [("autopar.codegen", 5, True)]
    assert layer_of("autopar.codegen") != layer_of("autopar.estimate.x")


def test_architecture_document_lists_the_layers_in_order() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| \d+ \| `([a-z_.]+)`", section, flags=re.M)
    assert tuple(listed) == LAYERS, f"docs/architecture.md lists {listed}"


@pytest.mark.parametrize("root", ["autopar", "cost_models", "benchmarks", "tests"])
def test_no_file_over_600_lines(root: str) -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / root).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"
