"""The GPU check script runs end to end at toy sizes on the CPU (it cannot rot between GPU loans)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, run the real check instead")
def test_gpu_check_smoke_run():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke"],
        cwd=ROOT / "tests", env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for title in ("Decode", "Prefill", "End to end", "Host tier"):
        assert title in out
    errors = [float(e) for e in re.findall(r"\| (\d\.\de[-+]\d+) \|", out)]
    assert len(errors) == 6 and max(errors) < 1e-4  # kernels agree with SDPA on every timed shape
    assert "| yes |" in out  # Triton-backed generate gave DynamicCache's tokens
    assert "promoted blocks bit-exact: yes" in out  # the host tier's copy path round-trips
    assert "still writes waits for it: yes" in out
    assert re.search(r"\| host-tier hit \| [\d.]+ \| [\d.]+x \| True \|", out)
