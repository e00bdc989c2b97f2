"""The package's import graph, read from the source with ``ast``: no cycles, and imports go one way
(commands -> tasks -> engine -> models -> core). Imports under ``if TYPE_CHECKING:`` are for annotations
only and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import repmlp

ROOT = Path(repmlp.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _targets(mod: str, path: Path, node: ast.ImportFrom, mods: dict[str, Path]) -> set[str]:
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    if node.level:
        base = package[: len(package) - node.level + 1] + ([node.module] if node.module else [])
        name = ".".join(base)
    else:
        name = node.module or ""
    # ``from pkg import mod`` imports the module ``pkg.mod``; ``from mod import name`` the module ``mod``.
    return {f"{name}.{a.name}" if f"{name}.{a.name}" in mods else name for a in node.names} & set(mods)


def import_graph() -> dict[str, set[str]]:
    """Module -> the repmlp modules it imports at run time (at any depth: lazy imports count)."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        annotation_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in annotation_only:
                continue
            if isinstance(node, ast.ImportFrom):
                deps |= _targets(mod, path, node, mods)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
        graph[mod] = deps - {mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (depth-first search), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "repmlp.tasks.classification" in graph  # the whole package was read
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_a_cycle_is_found_when_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_imports_go_one_way():
    """commands -> tasks -> engine -> models: no layer imports one above it."""
    above = {
        "repmlp.models": ("repmlp.engine", "repmlp.tasks", "repmlp.commands", "repmlp.cli"),
        "repmlp.engine": ("repmlp.tasks", "repmlp.commands", "repmlp.cli"),
        "repmlp.tasks": ("repmlp.commands", "repmlp.cli"),
    }
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in import_graph().items()
        for layer, higher in above.items()
        if mod == layer or mod.startswith(layer + ".")
        for dep in deps
        if dep.startswith(higher)
    ]
    assert not wrong, wrong
