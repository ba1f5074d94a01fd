"""bench/ablation.py: its smoke run prints the ablation's tables (every variant on both traces, a verdict
per rule) and leaves docs/benchmarks.md alone; every variant really switches something off, and
switches set in one process are put back after the run."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_bench_scripts import tables

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCS = ROOT / "docs" / "benchmarks.md"


@pytest.fixture
def ablation(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import ablation

    return ablation


@pytest.mark.slow
def test_smoke_run_prints_every_variant_on_both_traces_and_leaves_the_docs_alone(ablation):
    before = DOCS.read_bytes() if DOCS.exists() else None
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(BENCH / "ablation.py"), "--smoke"], cwd=ROOT / "tests", env=env,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "FAILED" not in out
    for text in ("### Ablation of the scheduling rules", "**Tidal trace**", "**Steady mixed workload**",
                 "**Verdicts**", "Method: forwards paced to", "Contention check:",
                 "(smoke run: docs/benchmarks.md not written)"):
        assert text in out, text
    tidal, steady, verdicts = tables(out)
    variants = [v for v in ablation.VARIANTS if ablation.available(v)]
    for table in (tidal, steady):
        assert all(len(row) == len(table[0]) for row in table), table
        assert [row[0] for row in table[1:]] == [*variants, "spread of all rules (max - min)"]
        assert all(re.fullmatch(r"\d+ of \d+, median \d+( \([+-]\d+\))?", row[1]) for row in table[1:-1]), table
        assert table[1][-1] == "baseline" and table[2][-1].startswith("the rules together: ")
        assert all(re.match(r"(helps|hurts|mixed|no gain)", row[-1]) for row in table[3:-1]), table
    assert "p99 TTFT at the peak s (Δ)" in tidal[0] and "p99 TTFT at the peak s (Δ)" not in steady[0]
    assert [row[0] for row in verdicts[1:]] == variants[2:]
    assert all(row[-1] in ("helps", "hurts", "mixed", "no gain") for row in verdicts[1:])
    assert (DOCS.read_bytes() if DOCS.exists() else None) == before, "a smoke run wrote docs/benchmarks.md"


def test_every_variant_switches_something_off_and_the_switches_are_put_back(ablation):
    from hf_paged_kv.engine import SLO

    size = dict(batch_tokens=64, dwell=1.0, tick=0.1)
    slo = SLO(ttft=1.0, per_token=0.1)
    switches = [(candidates, name) for listed in ablation.SWITCHES.values() for candidates, name, _ in listed]

    def library():
        return [vars(owner)[name] if (owner := ablation.owner_of(candidates, name)) else None
                for candidates, name in switches]

    before, base = library(), ablation.configured(ablation.BASELINE, size, slo)
    assert ablation.available(ablation.BASELINE) and ablation.available(ablation.CORE)
    assert ablation.available("no-pacing") and ablation.available("no-partial-rule")  # rules the library keeps
    for variant in filter(ablation.available, ablation.VARIANTS):
        with ablation.switched(variant):
            changed = library() != before
        assert library() == before, f"{variant}: a switch stayed set"
        controller, sized, thresholds = ablation.configured(variant, size, slo)
        configured = (controller, sized, thresholds) != base
        assert (changed or configured) == (variant != ablation.BASELINE), variant
    assert ablation.configured(ablation.CORE, size, slo)[0] is False
    assert ablation.configured("no-overload", size, slo)[2].overload_wait == math.inf
    assert ablation.owner_of(("hf_paged_kv.engine.no_such_module", "hf_paged_kv.engine.pacing"), "nothing") is None


def test_pressure_switch_keeps_every_knob_at_its_normal_value_in_pressure(ablation):
    from hf_paged_kv.engine.controller import Knob

    def knobs(engine):
        derive = lambda c: ({"normal": c, "pressure": c * 2, "overload": c * 4}, 0.0, 10.0)  # noqa: E731
        return [Knob("watermark", 0.1, *derive(0.1), apply=lambda v: None, derive=derive),
                Knob("max_batch_tokens", 64, {}, 16, 128, apply=lambda v: None)]

    watermark, budget = ablation.knobs_without_pressure(knobs)(None)
    assert watermark.targets == {"normal": 0.1, "pressure": 0.1, "overload": 0.4}
    assert watermark.derive(0.2)[0] == {"normal": 0.2, "pressure": 0.2, "overload": 0.8}
    assert budget.targets == {}


def test_verdict_counts_only_moves_beyond_the_spread_of_both_rows(ablation):
    def runs(*within, p99=1.0):
        return [dict(within=w, goodput=w / 100, p99=p99, p99_peak=p99, throughput=10.0, rejected=0) for w in within]

    base = runs(90, 91, 92)
    figures = {"within SLO": ablation.FIGURES["within SLO"], "p99 TTFT s": ablation.FIGURES["p99 TTFT s"]}
    assert ablation.moves(runs(89, 90, 91), base, figures) == ([], [])  # 1 below, inside the spread of 2
    assert ablation.moves(runs(87, 88, 88), base, figures) == (["within SLO -3"], [])
    assert ablation.moves(runs(95, 95, 95, p99=2.0), base, figures) == (["p99 TTFT s +1.00"], ["within SLO +4"])
    assert ablation.moves(runs(80, 88, 96), base, figures) == ([], [])  # the variant's own spread counts too
    assert ablation.verdict([], []) == "no gain"
    assert ablation.verdict(["within SLO -3"], []).startswith("helps")
    assert ablation.verdict([], ["within SLO +4"]).startswith("hurts")
    assert ablation.verdict(["a"], ["b"]).startswith("mixed")
