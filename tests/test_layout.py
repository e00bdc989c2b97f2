"""The package's import graph, read from the source with ``ast``: no cycles, and imports go one way
(commands -> tasks -> engine -> io -> models -> core). Imports under ``if TYPE_CHECKING:`` count too: a reader
follows them as any other."""

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


def imports(mod: str, path: Path, source: str, mods: dict[str, Path]) -> set[str]:
    """The repmlp modules that module ``mod`` (``source``, read from ``path``) imports, at any depth: lazy and
    type-only (``if TYPE_CHECKING:``) imports count."""
    deps: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            deps |= _targets(mod, path, node, mods)
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name in mods}
    return deps - {mod}


def import_graph() -> dict[str, set[str]]:
    """Module -> the repmlp modules it imports (:func:`imports`)."""
    mods = _modules()
    return {mod: imports(mod, path, path.read_text(), mods) for mod, path in mods.items()}


def test_a_type_only_import_counts():
    mods = _modules()
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from repmlp.io.model_file import ModelMetadata\n"
    assert imports("repmlp.data", mods["repmlp.data"], source, mods) == {"repmlp.io.model_file"}


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


# The folders of the package, lowest first: a module imports only from its own folder and the folders below it.
# ``io`` (model and state files) sits above ``models``: a file names the model to build, and the models never
# read files. ``engine`` and ``deploy`` share a rank and never import each other (training knows no
# deployment, and a deployed model needs no training loop); ``bench`` sits above both, since it measures
# what they produce.
RANKS = {
    "repmlp.errors": 0,
    "repmlp._version": 0,
    "repmlp.numerics": 0,
    "repmlp.nn": 1,
    "repmlp.data": 2,
    "repmlp.models": 3,
    "repmlp.io": 4,
    "repmlp.engine": 5,
    "repmlp.deploy": 5,
    "repmlp.bench": 6,
    "repmlp.tasks": 7,
    "repmlp.commands": 8,
    "repmlp.cli": 9,
    "repmlp.__main__": 10,
    "repmlp": 11,  # the package's __init__: the public names, from every folder
}


def folder(mod: str) -> str:
    """The folder of module ``mod``: its folder (``repmlp.nn.block`` -> ``repmlp.nn``), or the module itself at
    the top."""
    parts = mod.split(".")
    return ".".join(parts[:2])


def climbs(graph: dict[str, set[str]]) -> list[str]:
    """Every import of ``graph`` that goes to a higher folder, or sideways to another folder of the same rank."""
    wrong = []
    for mod, deps in graph.items():
        for dep in deps:
            a, b = folder(mod), folder(dep)
            if a != b and RANKS[b] >= RANKS[a]:
                wrong.append(f"{mod} imports {dep}")
    return sorted(wrong)


def folder_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle between folders (not only between modules): the graph of folders, each import an edge."""
    folders: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        folders.setdefault(folder(mod), set()).update(folder(d) for d in deps if folder(d) != folder(mod))
    for r in list(folders.values()):
        for d in r:
            folders.setdefault(d, set())
    return _cycle(folders)


def test_every_module_is_in_a_ranked_folder():
    graph = import_graph()
    assert {folder(m) for m in graph} == set(RANKS), {folder(m) for m in graph} ^ set(RANKS)
    top = sorted(m for m in graph if m.count(".") == 1 and not (ROOT / m.split(".")[1]).is_dir())
    assert top == ["repmlp.__main__", "repmlp._version", "repmlp.cli", "repmlp.errors", "repmlp.numerics"], (
        top
    )


def test_imports_go_one_way_between_folders():
    """commands -> tasks -> bench -> {deploy, engine} -> io -> models -> data -> nn -> {errors, numerics}."""
    graph = import_graph()
    assert climbs(graph) == []
    assert folder_cycle(graph) is None, " -> ".join(folder_cycle(graph) or [])


def test_a_climb_and_a_cycle_between_folders_are_found():
    graph = {
        "repmlp.nn.block": {"repmlp.models.registry"},  # climbs
        "repmlp.models.registry": {"repmlp.nn.ops"},
        "repmlp.nn.ops": set(),
        "repmlp.engine.loop": {"repmlp.deploy.export"},  # sideways
        "repmlp.deploy.export": set(),
    }
    assert climbs(graph) == [
        "repmlp.engine.loop imports repmlp.deploy.export",
        "repmlp.nn.block imports repmlp.models.registry",
    ]
    # no module cycle, but the folders nn and models import each other
    assert _cycle(graph) is None
    assert folder_cycle(graph) in (
        ["repmlp.models", "repmlp.nn", "repmlp.models"],
        ["repmlp.nn", "repmlp.models", "repmlp.nn"],
    )
