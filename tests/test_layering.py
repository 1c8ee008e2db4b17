"""The import graph keeps the layering of docs/architecture.md ("Layers and imports").

Imports are read from the source with ``ast`` (nothing is imported, so no
import side effects): module-level and function-level imports alike, since a
lazy import is still a dependency. Imports under ``if TYPE_CHECKING:`` are left
out: they never run, they only name types for annotations.

Rules:

* nothing under ``dspark_core`` imports ``dspark_plugins`` (the core reaches
  plugins only through hooks and entry points);
* no plugin module imports another plugin module (what two plugins share lives
  in the core);
* no import cycle between the parts of ``dspark_core`` (a subpackage, or a
  top-level module), except the ones listed in ``ALLOWED_CYCLES``;
* the models layer does not import the plugin manager, except the edges in
  ``ALLOWED_UPWARD``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source directory -> the package name it is imported as
PACKAGES = {"dspark_core": "dspark_core", "plugins": "dspark_plugins"}

# Cycles between parts of dspark_core that are still there, each as the set of
# parts in one strongly connected component. Empty: every cycle found while
# writing this test was broken (costs <-> calibration <-> table by moving the
# settings types into dspark_core.fit_settings). A new cycle fails the test; so
# does an entry here that no longer exists, so the list only shrinks.
ALLOWED_CYCLES: set[frozenset[str]] = set()

# (importing module, imported part) pairs where the models layer reaches up.
ALLOWED_UPWARD = {
    # load_target(hooks=None) falls back to the entry-point plugins for callers that
    # predate the hooks argument (the draft-training commands, tools, tests); the
    # engine's own callers (startup, generate) pass their hooks.
    ("dspark_core.models.loading", "dspark_core.plugins"),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement in ``source`` may refer to (``from a import b``: a and a.b)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the else branch does run
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules (dspark_core.*, dspark_plugins.*) it imports."""
    files = {module_name(p): p for d in PACKAGES for p in (ROOT / d).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        names = imported_names(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
        graph[name] = {n for n in names if n in files and n != name}
    return graph


def part(module: str) -> str | None:
    """The part of dspark_core a module belongs to: ``dspark_core.X`` (package or module)."""
    pieces = module.split(".")
    return ".".join(pieces[:2]) if pieces[0] == "dspark_core" and len(pieces) > 1 else None


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    parts: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        source = part(module)
        if source is None:
            continue
        parts[source].update(t for t in map(part, targets) if t is not None and t != source)
    return parts


def _who(graph: dict[str, set[str]], source: str, target: str) -> list[str]:
    return sorted(m for m, ts in graph.items() if part(m) == source and any(part(t) == target for t in ts))


# -- the scanner itself ----------------------------------------------------------------


def test_the_scanner_sees_lazy_relative_and_type_checking_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import dspark_core.errors\n"
        "from . import sibling\n"
        "from ..costs import base\n"
        "if TYPE_CHECKING:\n"
        "    from dspark_core.engine.records import StepReport\n"
        "else:\n"
        "    import dspark_core.geometry\n"
        "def late():\n"
        "    from dspark_plugins.devices import npu\n"
    )
    names = imported_names(source, "dspark_core.calibration.plan", is_package=False)
    assert {"dspark_core.errors", "dspark_core.calibration.sibling", "dspark_core.costs.base",
            "dspark_core.geometry", "dspark_plugins.devices.npu"} <= names
    assert not any(n.startswith("dspark_core.engine") for n in names)


def test_the_graph_is_not_empty(graph):
    assert len(graph) > 100
    assert "dspark_core.costs.base" in graph["dspark_core.calibration.plan"]
    assert "dspark_core.policy" in graph["dspark_plugins.policies.adaptive"]


def test_the_cycle_finder_finds_a_cycle():
    cycles = strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycles == [frozenset("abc")]


# -- the rules -------------------------------------------------------------------------


def test_the_core_never_imports_a_plugin(graph):
    offenders = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("dspark_core")
                       for t in ts if t.startswith("dspark_plugins"))
    assert offenders == [], "the core reaches plugins through hooks only:\n  " + "\n  ".join(offenders)


def test_no_plugin_imports_another_plugin(graph):
    offenders = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("dspark_plugins")
                       for t in ts if t.startswith("dspark_plugins"))
    assert offenders == [], "move what plugins share into dspark_core:\n  " + "\n  ".join(offenders)


def test_no_new_cycle_between_core_parts(graph):
    parts = part_graph(graph)
    cycles = set(strongly_connected(parts))
    new = cycles - ALLOWED_CYCLES
    details = [f"{sorted(c)}: " + "; ".join(f"{a} -> {b} ({', '.join(_who(graph, a, b))})"
                                             for a in sorted(c) for b in sorted(parts[a]) if b in c)
               for c in new]
    assert not new, "import cycle(s) between dspark_core parts:\n  " + "\n  ".join(details)
    stale = ALLOWED_CYCLES - cycles
    assert not stale, f"allowed cycles that no longer exist (remove them from ALLOWED_CYCLES): {stale}"


def test_the_models_layer_does_not_reach_up_to_the_plugin_manager(graph):
    upward = {(m, part(t)) for m, ts in graph.items() if m.startswith("dspark_core.models")
              for t in ts if part(t) in ("dspark_core.plugins", "dspark_core.startup", "dspark_core.engine",
                                         "dspark_core.server", "dspark_core.commands")}
    assert upward <= ALLOWED_UPWARD, f"models import upward: {sorted(upward - ALLOWED_UPWARD)}"
    assert ALLOWED_UPWARD <= upward, f"allowed upward imports that no longer exist: {sorted(ALLOWED_UPWARD - upward)}"
