"""The names README.md and docs/ show resolve: every dotted ``repmlp.x.y`` and every ``from repmlp.x import
y``, so that a move in the package cannot leave the documentation pointing at nothing."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Not preceded by a name, a dot or a path character: `torch.ops.repmlp.x` (our custom ops' namespace),
# `model.repmlp.fc3` (an attribute) and `src/repmlp/...` (a path) are not package names.
_DOTTED = re.compile(r"(?<![\w./-])repmlp(?:\.[A-Za-z_]\w*)+")
_FROM = re.compile(r"^\s*from (repmlp(?:\.\w+)*) import (\([^)]*\)|[^\n]*)", re.M)


def shown_names(text: str) -> set[str]:
    """The package names a Markdown text shows: dotted names and the names of ``from ... import`` lines."""
    names = set(_DOTTED.findall(text))
    for module, imported in _FROM.findall(text):
        for item in imported.strip("()").split("#")[0].replace("\n", ",").split(","):
            if item.strip():
                names.add(f"{module}.{item.split(' as ')[0].strip()}")
    return names


def resolve(name: str) -> object:
    """The object ``name`` names: its longest importable module prefix, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_the_docs_show_names():
    names = set().union(*(shown_names(p.read_text()) for p in DOCS))
    assert len(names) > 30 and "repmlp.models.sequence.SequenceMLP" in names  # the docs were read


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_name_the_docs_show_resolves(path: Path):
    missing = []
    for name in sorted(shown_names(path.read_text())):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name} ({type(exc).__name__})")
    assert not missing, f"{path.name}: {missing}"


def test_a_name_that_does_not_resolve_is_caught():
    text = "Call `repmlp.nn.ops.no_such_function`.\n\n```\nfrom repmlp.models import (create_model, nothing)\n```"
    names = shown_names(text)
    assert names >= {"repmlp.nn.ops.no_such_function", "repmlp.models.create_model", "repmlp.models.nothing"}
    with pytest.raises(AttributeError):
        resolve("repmlp.nn.ops.no_such_function")
    with pytest.raises(AttributeError):
        resolve("repmlp.models.nothing")
    assert resolve("repmlp.models.create_model") is not None
