"""The equality tests can fail: each bug `planted_bugs.py` plants (wrong scale, rotated heads, a
reused prefix at shifted positions, a dropped key, values paired with the wrong keys, a numeric
skew in decode only) makes most of the tests that exercise it fail, not one of forty."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REUSE_TESTS = "shared_prefix or batch_rows or stateless or identical or tenants_never or concurrent or pipeline"
SELECTION = {
    "scale": ["test_generate.py"],
    "heads_rotated": ["test_generate.py"],
    "cached_key_dropped": ["test_generate.py"],
    "kv_permuted_in_block": ["test_generate.py"],
    "decode_skew": ["test_generate.py"],
    "reused_positions_shifted": ["test_reuse.py", "-k", REUSE_TESTS],
}


def run_with(bug: str | None, args: list[str], tmp_path: Path) -> tuple[int, int]:
    """`(failed, passed)` of the selection with `bug` planted. Every failure must be a failed
    check: a plant that no longer fits the code it patches raises instead, and would be counted
    as caught (the plugin lists such tests)."""
    crashes = tmp_path / "crashes.txt"
    env = dict(os.environ) | ({"HF_PAGED_KV_PLANT": bug} if bug else {}) | {"HF_PAGED_KV_PLANT_CRASHES": str(crashes)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "planted_bugs",
                             *args], cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert not crashes.exists(), f"{bug}: tests failed by raising, not by a check: {crashes.read_text()[:600]}"
    summary = result.stdout.strip().splitlines()[-1]
    count = lambda word: int(m.group(1)) if (m := re.search(rf"(\d+) {word}", summary)) else 0  # noqa: E731
    return count("failed"), count("passed")


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(SELECTION))
def test_equality_tests_catch_the_planted_bug(bug, tmp_path):
    failed, passed = run_with(bug, SELECTION[bug], tmp_path)
    assert failed + passed >= 7, (failed, passed)
    assert failed / (failed + passed) >= 0.5, f"only {failed} of {failed + passed} tests caught {bug}"


@pytest.mark.slow
def test_without_a_planted_bug_the_selection_passes(tmp_path):
    failed, passed = run_with(None, SELECTION["reused_positions_shifted"], tmp_path)
    assert failed == 0 and passed >= 7
