"""The library's shape: no module reaches into another object's private attributes, and no two
modules import each other (directly or around a longer loop). Size is not checked: a class is
as long as its one job needs."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "hf_paged_kv").rglob("*.py"), *(ROOT / "kernels").glob("*.py")])
# transformers offers no public getter for the attention implementation a model runs
# (`set_attn_implementation` sets it); its own guides read `config._attn_implementation`.
# torch offers none for a tensor's version counter either (autograd's in-place checks read
# `tensor._version`); the fingerprint watches it for weights edited in place.
EXTERNAL_PRIVATE_ALLOWED = {"_attn_implementation", "_version"}


def private_accesses(tree: ast.AST) -> list[tuple[int, str]]:
    """`x._name` where `x` is not `self`, `cls` or `super()` (dunder names such as `__class__`
    are public)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            inherited = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
            if not (own or inherited or node.attr in EXTERNAL_PRIVATE_ALLOWED):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_attribute_of_another_object(path):
    assert private_accesses(ast.parse(path.read_text())) == []


def test_the_check_sees_a_private_access():
    source = "pool._lock.acquire()\nself._fine = 1\nx.__class__\nsuper()._forward()\ntwin._model = 1"
    assert private_accesses(ast.parse(source)) == [(1, "pool._lock"), (5, "twin._model")]


def module_name(path: Path) -> str:
    """The dotted name a source file is imported as (`kernels/` ships as `hf_paged_kv.kernels`)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kernels":
        parts.insert(0, "hf_paged_kv")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The library modules a file imports anywhere in it (function bodies and `TYPE_CHECKING`
    blocks too): `from .pkg import name` counts `pkg.name` when that is a module, else `pkg`."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            modules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            found.update(modules)
            if target in known and len(modules) < len(node.names):
                found.add(target)
    return found - {name}


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the import graph (empty when there is none)."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return error.args[1]
    return []


def test_no_import_cycle():
    known = {module_name(path) for path in SOURCES}
    assert import_cycle({module_name(path): imports_of(path, known) for path in SOURCES}) == []


def test_the_check_sees_an_import_cycle():
    cycle = import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert set(cycle) == {"a", "b", "c"} and cycle[0] == cycle[-1]
    assert import_cycle({"a": {"b"}, "b": set()}) == []
