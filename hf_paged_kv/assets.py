"""Model files shipped inside PyPI packages, located without importing those packages (their
import can pull heavy dependencies) and without any download."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_file(module: str, relative: str, install_hint: str) -> Path:
    """`relative` inside the installed package `module`, or FileNotFoundError saying how to get it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{module} is not installed: {install_hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise FileNotFoundError(f"{module} is installed but {path} is missing: {install_hint}")
    return path
