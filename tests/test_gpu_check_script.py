"""The GPU check script runs end to end at toy sizes on the CPU (it cannot rot between GPU loans)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"
ERROR = r"\d\.\de[-+]\d+"


def run_script(*args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    """Run a bench script as a user would: without TRITON_INTERPRET (`--smoke` must set it early
    enough itself)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT / "tests", env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, run the real check instead")
def test_gpu_check_smoke_run():
    result = run_script("--smoke")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for title in ("Decode", "Prefill", "End to end", "Host tier"):
        assert title in out
    assert re.search(r"All \d+ checks passed", out)
    # every kernel row: errors of both sides against fp32 attention, within the stated tolerance
    kernel_rows = re.findall(rf"\| ({ERROR}) \| ({ERROR}) \| (\de[-+]\d+) \| ok \|", out)
    assert len(kernel_rows) == 4
    assert all(float(ours) <= float(tol) and float(sdpa) <= float(tol) for ours, sdpa, tol in kernel_rows)
    assert "tokens identical to DynamicCache's: yes" in out  # Triton-backed generate, fp32, left padding
    assert re.search(r"\| 1 \| 16 \| 2 \| \d+ \| \d+ \| [\d.]+x \| 100% \|", out)
    assert "promoted blocks bit-exact: yes" in out  # the host tier's copy path round-trips
    assert "still writes waits for it: yes (promoted into straggled blocks only)" in out
    assert re.search(r"\| host-tier hit \| [\d.]+ \| [\d.]+x \| 32 \| yes \|", out)
    assert re.search(r"\[\d\d:\d\d:\d\d \+\s*[\d.]+s\] Host tier: done", result.stderr)  # progress, stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, run the real check instead")
def test_gpu_check_lists_what_failed_and_exits_non_zero(monkeypatch, capsys):
    """With no time left every step counts as failed: the run says what and returns 1 (in this
    process: nothing but the bookkeeping runs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    gpu_check = importlib.import_module("gpu_check")
    assert gpu_check.main(["--smoke", "--budget", "0"]) == 1
    out = capsys.readouterr().out
    assert "FAILED CHECKS (nothing written to docs/benchmarks.md)" in out
    for step in ("Decode", "Prefill", "End to end", "Host tier"):
        assert f"- {step}: not run, the time budget of 0 s was spent" in out
    assert "4 of 4 checks FAILED" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, run the real tuning instead")
def test_kernel_tuning_smoke_run():
    result = run_script("--smoke", script=ROOT / "bench" / "tune_kernels.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    # every prefill candidate and the default again: timed, checked against fp32 attention
    prefill_rows = re.findall(rf"\| \d+ \| \d+ \| \d+ \| \d+(?: \(default\))? \| \d+ \| \d+ \| \d+ \| [\d.]+ \| ({ERROR}) \| ok \|", out)
    assert len(prefill_rows) == 2 * 3  # two shapes x (two candidates + the default again)
    assert out.count("| fastest |") >= 2
    decode_rows = re.findall(rf"\| toy \| 1 \| 70 \| (\d+)(?: \(chosen\))? \| [\d.]+ \| [\d.]+ \| {ERROR} \|", out)
    assert decode_rows == ["1"]  # 70 tokens: one split only (a split takes 64 keys at least)
