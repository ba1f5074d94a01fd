"""A non-editable install holds every module of the source tree (the development venv uses an
editable install, which would hide a package missing from pyproject.toml's list)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["hf_paged_kv", "hf_paged_kv.tiers.disk", "hf_paged_kv.reuse.semantic", "hf_paged_kv.kernels.paged_decode"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A fresh copy of what a build reads: a build in the tree reuses its stale build/ folder."""
    copy = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in ("hf_paged_kv", "kernels"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    return copy


def pip(*args):
    command = [sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "-q"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_wheel_ships_every_module(source, tmp_path):
    pip("wheel", "-w", str(tmp_path), str(source))
    (wheel,) = tmp_path.glob("hf_paged_kv-*.whl")
    import hf_paged_kv

    assert wheel.name.startswith(f"hf_paged_kv-{hf_paged_kv.__version__}-")  # pyproject reads the package's version
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    library = {str(p.relative_to(source)) for p in (source / "hf_paged_kv").rglob("*.py")}
    kernels = {"hf_paged_kv/" + str(p.relative_to(source)) for p in (source / "kernels").glob("*.py")}
    assert (library | kernels) - shipped == set()


def test_installed_copy_imports_without_the_source_tree(source, tmp_path):
    site = tmp_path / "site"
    pip("install", "--target", str(site), str(source))
    # -I -S: neither the source tree nor the venv's editable install (a .pth hook) is visible;
    # the venv's site-packages come back by hand, without their .pth hooks, for torch and transformers
    dependencies = [p for p in sys.path if p.endswith("site-packages")]
    code = (f"import sys; sys.path[:0] = [{str(site)!r}, *{dependencies!r}]; "
            f"import importlib; [importlib.import_module(m) for m in {MODULES!r}]; "
            "import hf_paged_kv; print(hf_paged_kv.__file__)")
    result = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().startswith(str(site))
