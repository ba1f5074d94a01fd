"""The Triton kernels compile with the GPU compiler, not only in the interpreter the other kernel
tests use: for H100/H200 (sm_90) with this environment's Triton and with Triton 3.6, the release
on the GPU machines (installed beside the venv by scripts/bootstrap.sh), and for A100 (sm_80)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TRITON_36 = Path(sys.prefix) / "triton-3.6"
KERNELS = {"decode_split_kernel", "merge_splits_kernel", "prefill_kernel", "write_kv_kernel"}


def compiler_env(**extra) -> dict[str, str]:
    """This process's environment without the interpreter switch conftest sets, so Triton compiles."""
    return {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"} | extra


@pytest.mark.slow
@pytest.mark.parametrize(
    "triton_path, arch", [(None, 90), (TRITON_36, 90), (None, 80)], ids=["sm90-venv", "sm90-triton3.6", "sm80-venv"]
)
def test_every_kernel_variant_compiles_without_spills(triton_path, arch, tmp_path):
    if triton_path is not None and not triton_path.exists():
        pytest.skip(f"{triton_path} not installed (scripts/bootstrap.sh installs it on machines without a GPU)")
    env = compiler_env(TRITON_CACHE_DIR=str(tmp_path))  # compile for real, not from an earlier run's cache
    if triton_path is not None:
        env["PYTHONPATH"] = str(triton_path)
    result = subprocess.run(
        [sys.executable, "-m", "hf_paged_kv.kernels.compile_check", "--arch", str(arch)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    header, columns, *rows = result.stdout.strip().splitlines()
    if triton_path is not None:
        assert header.startswith("triton 3.6.0"), header
    rows = [dict(zip(columns.split(), row.split())) for row in rows]
    assert {row["kernel"] for row in rows} == KERNELS
    assert {row["dtype"] for row in rows} == {"fp32", "fp16", "bf16"}
    assert {row["head_dim"] for row in rows} == {"64", "96", "128"}
    assert [row for row in rows if row["spill_bytes"] != "0"] == []
    assert all(int(row["shared_bytes"]) <= 163 * 1024 for row in rows)  # sm_80's shared memory per block


def test_compile_check_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "hf_paged_kv.kernels.compile_check", "--quick"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode != 0
    assert "unset TRITON_INTERPRET" in result.stderr


NARROW_DOT = """
import dataclasses, torch, triton
from triton.backends.compiler import GPUTarget
from hf_paged_kv.kernels import compile_check
launch = compile_check.launches(compile_check.Variant(torch.bfloat16, 64, 4, 16))[0]
narrow = dataclasses.replace(launch, constexprs=dict(launch.constexprs, TILE=8))  # p @ v with K = 8
triton.compile(compile_check.specialize(narrow), target=GPUTarget("cuda", 90, 32))
"""


@pytest.mark.slow
def test_compile_check_catches_what_only_the_gpu_compiler_rejects():
    """A 16-bit tl.dot with K = 8 runs in the interpreter; the sm_90 compiler must refuse it here."""
    result = subprocess.run([sys.executable, "-c", NARROW_DOT], capture_output=True, text=True, env=compiler_env(),
                            timeout=300)
    assert result.returncode != 0
    assert "CompilationError" in result.stderr, result.stderr[-2000:]
