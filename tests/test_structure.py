"""The library's shape: no module reaches into another object's private attributes, and no class
grows past one job (about 250 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "hf_paged_kv").rglob("*.py"), *(ROOT / "kernels").glob("*.py")])
MAX_CLASS_LINES = 250
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


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_class_longer_than_one_job(path):
    classes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
    long = {c.name: c.end_lineno - c.lineno + 1 for c in classes if c.end_lineno - c.lineno + 1 > MAX_CLASS_LINES}
    assert long == {}


def test_the_check_sees_a_private_access():
    source = "pool._lock.acquire()\nself._fine = 1\nx.__class__\nsuper()._forward()\ntwin._model = 1"
    assert private_accesses(ast.parse(source)) == [(1, "pool._lock"), (5, "twin._model")]
