"""The serving benchmarks run end to end at toy sizes (`--smoke`: a tiny random Llama, a few
seconds of trace): bench/bench_engine.py (issue 11) and bench/bench_load.py (issue 12). Each must
exit 0, print its tables with every system in them, and leave docs/ alone (no benchmarks.md
section, no plot). Both start when the module begins, so it takes about as long as the slower one."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_bench_scripts import tables

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCS = ROOT / "docs"
NOT_WRITTEN = "(smoke run: docs/benchmarks.md not written)"

EXPECTED = {
    "bench_engine": dict(
        texts=["### Serving engine", "**Arrivals 40/s**", "**Arrivals all at once**", "**Throughput ratios**",
               "Compute floor:", "**Concurrency at the same memory**", "Method:", "![throughput and p95 TTFT"],
        systems=["sequential generate", "micro-batches of", "transformers CB", "engine"],
        tables=4),
    "bench_load": dict(
        texts=["### Tidal load", "SLO targets:", "**Service**", "**Latency**", "**Targets**", "Method:",
               "![load, queue, KV usage"],
        systems=["engine, controller on", "engine, controller off", "transformers CB"],
        tables=3),
}


def docs_state() -> dict[str, object]:
    """What these scripts would write in a full run: their sections of benchmarks.md and their
    plots (other sections may change meanwhile: other developers' runs)."""
    md = DOCS / "benchmarks.md"
    text = md.read_text() if md.exists() else ""
    state: dict[str, object] = {section: re.findall(rf"<!-- {section} -->.*?<!-- /{section} -->", text, re.S)
                                for section in ("engine", "load")}
    for name in ("bench_engine.png", "bench_load.png"):
        path = DOCS / name
        state[name] = (path.stat().st_size, path.stat().st_mtime_ns) if path.exists() else None
    return state


@pytest.fixture(scope="module")
def runs():
    before = docs_state()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU paths, as CI runs them
    processes = {script: subprocess.Popen([sys.executable, str(BENCH / f"{script}.py"), "--smoke"],
                                          cwd=Path(__file__).parent, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)
                 for script in EXPECTED}
    yield processes, before
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("tokens,outputs,pack", [(7656, [59] + [14] * 63, 256), (7656, [10] * 64, 256),
                                                 (100, [3, 2], 64), (50, [40], 64), (64, [1], 64)])
def test_compute_floor_schedules_feed_every_token_in_forwards_any_schedule_could_use(monkeypatch, tokens, outputs,
                                                                                    pack):
    monkeypatch.syspath_prepend(str(BENCH))
    schedules = importlib.import_module("bench_engine").floor_schedules(tokens, outputs, pack)
    fewest = max(-(-tokens // pack), max(outputs))
    assert len(schedules["packed"]) == -(-tokens // pack)
    assert len(schedules["even"]) == len(schedules["front"]) == fewest
    for forwards in schedules.values():
        assert sum(n for n, _ in forwards) == tokens
        assert all(1 <= keep <= n <= pack for n, keep in forwards)
        assert sum(keep for _, keep in forwards) >= sum(outputs)
    assert max(n for n, _ in schedules["even"]) - min(n for n, _ in schedules["even"]) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("script", list(EXPECTED))
def test_smoke_run_prints_its_tables_and_writes_nothing(runs, script):
    processes, before = runs
    stdout, stderr = processes[script].communicate(timeout=300)
    assert processes[script].returncode == 0, stdout[-3000:] + stderr[-3000:]
    expected = EXPECTED[script]
    for text in expected["texts"] + [NOT_WRITTEN]:
        assert text in stdout, f"{text!r} missing from:\n{stdout[-3000:]}"
    found = tables(stdout)
    assert len(found) == expected["tables"], stdout
    first_column = {row[0] for table in found for row in table[1:]}
    for system in expected["systems"]:
        assert any(cell.startswith(system) for cell in first_column), (system, first_column)
    assert "FAILED CHECKS" not in stdout
    assert docs_state() == before, "a smoke run touched docs/"
