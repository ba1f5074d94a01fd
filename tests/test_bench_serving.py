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
        texts=["### Tidal load", "SLO targets:", "**Service**", "**Latency**", "**Targets**", "**What this machine allows**",
               "Method:", "![load, queue, KV usage"],
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


# ------------------------------------------------------------- the bound on what any schedule could do

@pytest.fixture()
def feasibility(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("feasibility")


def edf_meets_all(arrivals, works, ttft) -> bool:
    """Whether preemptive earliest-deadline-first on one server (no fixed cost per forward) gives
    every request its work before arrival + ttft: exact for that model, EDF being optimal there."""
    pending, t, events = [], 0.0, sorted(zip(arrivals, works))
    i = 0
    while i < len(events) or pending:
        if not pending:
            t = max(t, events[i][0])
        while i < len(events) and events[i][0] <= t + 1e-12:
            pending.append([events[i][0] + ttft, events[i][1]])
            i += 1
        pending.sort()
        deadline, work = pending[0]
        run = min(work, (events[i][0] - t) if i < len(events) else work)
        t += run
        pending[0][1] -= run
        if pending[0][1] <= 1e-12:
            if t > deadline + 1e-9:
                return False
            pending.pop(0)
    return True


def test_the_bound_counts_what_one_span_cannot_hold(feasibility):
    most = feasibility.most_in_time
    assert most([0, 0], [0.6, 0.6], ttft=1.0, fixed=0.0) == 1  # 1.2 s of work in 1 s
    assert most([0, 0], [0.6, 0.6], ttft=1.2, fixed=0.0) == 2
    assert most([0, 0], [0.5, 0.5], ttft=1.0, fixed=0.1) == 1  # one forward's fixed cost on top
    assert most([0], [0.5], ttft=1.0, fixed=0.6) == 0  # even alone
    assert most([0, 0, 0], [0.2, 0.9, 0.3], ttft=1.0, fixed=0.0) == 2  # the largest goes
    # disjoint overloaded spans add up; an easy request between them costs nothing
    assert most([0, 0, 5, 10, 10], [0.6, 0.6, 0.1, 0.6, 0.6], ttft=1.0, fixed=0.0) == 3
    # a later arrival within the span still has to share it
    assert most([0, 0.5], [0.8, 0.8], ttft=1.0, fixed=0.0) == 1
    # exactly in time counts as in time, float rounding (0.1 + 0.2 > 0.3) included
    assert most([0], [0.0], ttft=1.0, fixed=1.0) == 1
    assert most([0, 0], [0.1, 0.2], ttft=0.3, fixed=0.0) == 2
    # more requests in one span than it considers: the bound only loosens
    assert 100 <= most([0.0] * 300, [0.01] * 300, ttft=1.0, fixed=0.0) < 300
    with pytest.raises(ValueError, match="must be > 0"):
        most([0], [0.1], ttft=0.0, fixed=0.0)


def one_forward_each_ttfts(arrivals, works, fixed) -> list[float]:
    """Sorted times to first token when each request, in arrival order, gets one forward of its own
    (`fixed + work` seconds), as soon as the previous one is done."""
    done, ttfts = 0.0, []
    for t, w in sorted(zip(arrivals, works)):
        done = max(done, t) + fixed + w
        ttfts.append(done - t)
    return sorted(ttfts)


def one_forward_each_meets_all(arrivals, works, ttft, fixed) -> bool:
    """Whether serving each request in a forward of its own (`one_forward_each_ttfts`, deadline
    order being arrival order) meets every deadline."""
    return all(x <= ttft + 1e-9 for x in one_forward_each_ttfts(arrivals, works, fixed))


def test_the_bound_is_never_below_what_a_schedule_achieves(feasibility):
    """Exhaustively on small random traces: the largest set of requests that preemptive EDF serves
    in time (a real schedule in the bound's model with no fixed cost), or that one forward per
    request serves with a fixed cost, never exceeds the bound."""
    import itertools

    import numpy as np

    rng = np.random.default_rng(0)
    tight = 0
    for _ in range(150):
        n = int(rng.integers(1, 7))
        arrivals = sorted(rng.uniform(0, 3, n).round(2).tolist())
        works = rng.uniform(0.05, 0.8, n).round(2).tolist()
        subsets = [s for k in range(n + 1) for s in itertools.combinations(range(n), k)]
        best = max(len(s) for s in subsets
                   if edf_meets_all([arrivals[i] for i in s], [works[i] for i in s], 1.0))
        bound = feasibility.most_in_time(arrivals, works, 1.0, 0.0)
        assert best <= bound <= n
        best_fixed = max(len(s) for s in subsets
                         if one_forward_each_meets_all([arrivals[i] for i in s], [works[i] for i in s], 1.0, 0.1))
        assert best_fixed <= feasibility.most_in_time(arrivals, works, 1.0, 0.1) <= bound
        tight += best == bound
    assert tight >= 140  # and it is seldom loose on traces this small


def test_uncached_tokens_count_only_what_no_request_in_time_shares(feasibility):
    system = [1, 2, 3, 4]
    prompts = [system + [5, 6], system + [7], [9, 9, 9], system + [5, 6, 8]]
    arrivals = [0.0, 0.5, 0.6, 10.0]
    # the first shares its system prompt with the second (arriving before its deadline), the second
    # with the first; the third shares nothing; the last extends the first (long gone: cached)
    assert feasibility.uncached_tokens(prompts, arrivals, ttft=1.0) == [2, 1, 3, 1]
    # the first cannot count on the second when it arrives after its deadline
    assert feasibility.uncached_tokens(prompts, [0.0, 1.5, 1.6, 10.0], ttft=1.0) == [6, 1, 3, 1]
    assert feasibility.uncached_tokens([[5, 5], [5, 5]], [0, 0], ttft=1.0) == [1, 1]  # the last token is computed


def test_forward_line_lies_under_every_median(feasibility):
    timings = {1: [0.11, 0.10, 0.30], 32: [0.16, 0.15, 0.15], 128: [0.36, 0.34, 0.35], 256: [0.62, 0.70, 0.61]}
    calls = {n: iter([0.0] + t if n == 256 else t) for n, t in timings.items()}  # the first call warms up
    fixed, per_token = feasibility.forward_line(lambda n: next(calls[n]), sorted(timings), repeats=3)
    medians = {1: 0.11, 32: 0.15, 128: 0.35, 256: 0.62}
    assert all(fixed + per_token * n <= m + 1e-12 for n, m in medians.items())
    assert abs(fixed + per_token - 0.11) < 1e-12  # through the smallest forward
    assert abs(fixed + per_token * 32 - 0.15) < 1e-12  # the least slope that stays under the others
    with pytest.raises(ValueError, match="two different sizes"):
        feasibility.forward_line(lambda n: 0.1, [8, 8])
    # a chord through the smallest forward that would cross zero: the line goes through the origin
    steep = {1: 0.010, 32: 0.5, 256: 4.0}
    fixed, per_token = feasibility.forward_line(lambda n: steep[n], sorted(steep), repeats=1)
    assert fixed == 0.0 and all(per_token * n <= t for n, t in steep.items())


def test_ttft_floors_lie_under_what_a_schedule_achieves(feasibility):
    """On random traces, the k-th fastest first token of a real schedule (one forward per request in
    arrival order) is never within the k-th floor; with no fixed cost that schedule serves every
    request in time exactly when the bound allows all, so the last floor lies within one 1% step of
    its slowest first token."""
    import numpy as np

    rng = np.random.default_rng(1)
    for _ in range(100):
        n = int(rng.integers(1, 12))
        arrivals = rng.uniform(0, 3, n).round(2).tolist()
        works = rng.uniform(0.05, 0.8, n).round(2).tolist()
        for fixed in (0.0, 0.1):
            floors = feasibility.ttft_floors(lambda target: feasibility.most_in_time(arrivals, works, target, fixed),
                                             n, start=0.01)
            achieved = one_forward_each_ttfts(arrivals, works, fixed)
            assert all(ttft > floor for ttft, floor in zip(achieved, floors))
            if fixed == 0.0:
                assert achieved[-1] <= floors[-1] * feasibility.STEP * (1 + 1e-9)


def test_ttft_floors_by_hand(feasibility):
    # two requests at once, one second of work each: the first token by 1 s at the soonest, the second by 2 s
    floors = feasibility.ttft_floors(lambda target: feasibility.most_in_time([0, 0], [1, 1], target, 0.0), 2, 0.5)
    assert 0.99 <= floors[0] < 1.0 and 1.98 <= floors[1] < 2.0
    # a count that falls at a longer target bounds the shorter ones too (more time never serves fewer)
    counts = iter([1, 0, 2])
    assert feasibility.ttft_floors(lambda target: next(counts), 2, 1.0) == [1.01, 1.01]
    # where the first target already allows k, nothing is claimed for the k-th
    assert feasibility.ttft_floors(lambda target: 1 if target < 1.5 else 2, 2, 1.0)[0] == 0.0
    with pytest.raises(ValueError, match="must be > 0"):
        feasibility.ttft_floors(lambda target: 1, 1, 0.0)


def test_the_report_compares_the_peak_floor_with_the_p99_target(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench_load = importlib.import_module("bench_load")
    reqs = [bench_load.Req(i, [1, 2, 3], 4) for i in range(99)]
    slo = bench_load.SLO(ttft=1.3, per_token=0.7)
    bound = dict(fixed=0.1, per_token=0.002, sizes=[1, 32], most=98, tokens=200, short_ttft=1.6, enough_ttft=1.7,
                 peak_floors=[0.1] * 28 + [0.9, 1.2, 1.55])

    def text(wanted, served, floors=bound["peak_floors"]):
        return bench_load.bound_text(reqs, slo, {**bound, "peak_floors": floors}, wanted, served)

    # p95 and p99 of the floors: 0.9 + 0.5 x 0.3 = 1.05, 1.2 + 0.7 x 0.35 = 1.445 (rounded down); all 31 served
    assert "at least 0.10 / 1.05 / 1.44 s" in text(1.0, 31)
    assert "completed all of them; over as many, no schedule's p99 is below 1.44 s, above half" in text(1.0, 31)
    assert "out of this machine's reach" in text(1.0, 31)
    assert "not above half the uncontrolled engine's (1.500 s): the bound does not rule" in text(1.5, 31)
    # 29 served: their p99 is bounded by the 29 fastest floors, 0.1 + 0.72 x 0.8 = 0.676, rounded down
    assert "completed 29 of them; over as many, no schedule's p99 is below 0.67 s, not above" in text(0.7, 29)
    assert "completed" not in text(float("nan"), 31)  # no target to compare with
    assert "Latency at the peak" not in text(1.0, 0, floors=[])
