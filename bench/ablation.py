"""An ablation of the engine's scheduling rules (issue 49): each rule switched off alone, on two traces,
against the engine with every rule and the engine with nothing but the core.

    python bench/ablation.py                          # every variant, 3 alternating repeats, 4 runs at a time
    python bench/ablation.py --variants "all rules" core no-triage --repeats 5 --parallel 3
    python bench/ablation.py --smoke                  # tiny sizes, every variant once, in-process; prints only
    python bench/ablation.py --traces overload --variants "all rules" core no-shedding no-overload

A rule beyond the core (a token budget, a cap on running sequences, admission by free blocks) stays
only if switching it off worsens a named figure – requests within the SLO (availability), goodput,
p99 time to first token, throughput, requests rejected – by more than the run-to-run spread.

Traces, both on `emulate_load`'s stand-in (a tiny random Llama whose forwards sleep to SmolLM2's
measured forward-time line, each request generating as many tokens as SmolLM2 gives it): the tidal
trace (bench_load's: 99 requests over 180 s, its pool, host tier, limits) and the steady mixed
workload (bench_engine's 64 requests, Poisson arrivals at `--steady-rate`, its pool and limits, and a
host tier as large as the pool, as bench_load gives its engines). Neither enters the controller's
overload state, so a third trace exists for the rules that only act there (shedding, the overload
state): `overload`, the tidal trace's requests arriving `OVERLOAD_RATE` times as fast for a minute, far
past what the engine serves within its targets; it has a section of its own. SLO targets of each trace are
calibrated the way bench_load does (5 x the time to first token alone, 3 x the per-token latency of 8
requests decoding together), on the stand-in paced to the line: the model of the machine the runs use,
and no measure of whatever else the machine runs meanwhile. `--line` gives the line instead of
measuring it (a busy machine inflates the model's own forward times).

Variants (each run in a process of its own; a switch without a `Limits` field or a `Thresholds` value
is a module constant or function of the library replaced in that process before the engine starts):
`all rules`: the engine with its controller and SLO targets; `core`: without the controller and
without targets (`Limits`' other defaults kept); and with the controller, each rule off alone, see
`VARIANTS`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import multiprocessing
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import bench_engine
import bench_load
import common
import numpy as np
import torch
from bench_engine import Req, blocks_for, completed, load, model_alone, poisson, serve_engine
from bench_engine import stop_ids, workload
from common import Checks, arguments, markdown_table, model_name, note
from emulate_load import stand_in
from feasibility import forward_line

import hf_paged_kv
from hf_paged_kv.engine import SLO, Thresholds

# name -> (what is switched off, how); "all rules" and "core" are the baselines
VARIANTS = {
    "all rules": ("nothing (the baseline)", "`controller=True`, SLO targets"),
    "core": ("every rule beyond the core", "`controller=False`, no targets"),
    "no-triage": ("triage: late requests yield to those still in time", "`admission.LATE_YIELD = 0`"),
    "no-partial-rule": ("partial chunks that would delay first tokens wait", "`PARTIAL_DELAY = inf` (admission's or the scheduler's)"),
    "no-pacing": ("pacing: forwards shrunk to the decodes' per-token slack",
                  "`pacing.paced_budget` returns `max_batch_tokens`"),
    "no-burst": ("bursts: a forward past `max_batch_tokens` for first tokens in time",
                 "`Limits.burst_batch_tokens = max_batch_tokens`"),
    "no-yielding": ("yielding: decodes with slack swapped out for first tokens", "`yielding.MIN_SLACK = inf`"),
    "no-prefetch": ("prefetch of waiting prefixes from the host tier", "`Limits.prefetch_depth = 0`"),
    "no-shedding": ("shedding in overload (the shed level never raised)", "`Controller._shedding` a no-op"),
    "no-growth-estimate": ("the growth reserve capped by finished requests' outputs",
                           "`Limits.growth_from_outputs = False`"),
    "no-pressure": ("the controller's pressure state (its knob moves)",
                    "every knob's pressure target = its normal one"),
    "no-overload": ("the controller's overload state (and with it shedding)", "`Thresholds.overload_wait = inf`"),
    "no-budget-rule": ("the controller's batch-budget moves", "`Controller._batch_budget` a no-op"),
    "no-backfill": ("backfill: later requests that fit pass one memory turns away", "`Limits.backfill_wait = 0`"),
}
BASELINE, CORE = "all rules", "core"
# figure -> (key in a run's result, +1: higher is better / -1: lower is better, digits)
FIGURES = {
    "within SLO": ("within", 1, 0),
    "goodput /s": ("goodput", 1, 3),
    "p99 TTFT s": ("p99", -1, 2),
    "p99 TTFT at the peak s": ("p99_peak", -1, 2),
    "tokens/s": ("throughput", 1, 1),
    "rejected": ("rejected", -1, 0),
}
HIGH_FIGURE = {"priority 1 within SLO": ("within_high", 1, 0)}  # what shedding protects: the overload trace's
TRACES = ("tidal", "steady", "overload")
DEFAULT_TRACES = ("tidal", "steady")  # the overload trace runs on its own: only the overload rules act there
OVERLOAD_RATE, OVERLOAD_MINUTES = 5.0, 1.0  # the tidal trace's mean rate times this, for this long
STEADY_RATE = 2.0  # requests/s: bench_engine's middle rate, the busiest with Poisson gaps
STEADY_SEED = 1001  # bench_engine's seed for its second rate (2/s)
SMOKE_TIDAL = dict(minutes=0.02, drain=10.0)  # a shorter smoke trace than bench_load's: every variant runs it
SMOKE_STEADY_RATE = 40.0  # bench_engine's smoke rate


# ----------------------------------------------------------------------------- the switches

def knobs_without_pressure(original):
    """`controller.engine_knobs` whose every knob keeps its normal value in the pressure state."""
    def same_as_normal(derive):
        def derived(configured):
            targets, low, high = derive(configured)
            if "pressure" in targets and "normal" in targets:
                targets = dict(targets, pressure=targets["normal"])
            return targets, low, high
        return derived

    def knobs(*args):  # the library's arguments, whichever they are (an engine, or its limits and pool)
        made = original(*args)
        for knob in made:
            if "pressure" in knob.targets and "normal" in knob.targets:
                knob.targets = dict(knob.targets, pressure=knob.targets["normal"])
            if knob.derive is not None:
                knob.derive = same_as_normal(knob.derive)
        return made
    return knobs


def no_paced_budget(running, decodes, limits, costs, now):
    """`pacing.paced_budget` without its rule: the configured budget, whatever the decodes' slack."""
    return limits.max_batch_tokens


def no_shedding(self, now, priorities):
    """`Controller._shedding` without its rule: the shed level never rises."""


def no_batch_budget(self, signals, short, current, now):
    """`Controller._batch_budget` without its rule: the budget stays where it is."""


# variant -> the library's module-level switches it sets: (modules that may hold it, the first that
# does; "module:Class" for a class attribute), attribute, value (a callable of the original: a wrapper)
SWITCHES = {
    "no-triage": [(("hf_paged_kv.engine.admission",), "LATE_YIELD", 0.0)],
    "no-partial-rule": [(("hf_paged_kv.engine.admission", "hf_paged_kv.engine.scheduler"), "PARTIAL_DELAY", math.inf)],
    "no-pacing": [(("hf_paged_kv.engine.pacing",), "paced_budget", no_paced_budget)],
    "no-yielding": [(("hf_paged_kv.engine.yielding",), "MIN_SLACK", math.inf)],
    "no-shedding": [(("hf_paged_kv.engine.controller:Controller",), "_shedding", no_shedding)],
    "no-budget-rule": [(("hf_paged_kv.engine.controller:Controller",), "_batch_budget", no_batch_budget)],
    "no-pressure": [(("hf_paged_kv.engine.load",), "engine_knobs", knobs_without_pressure)],
}
# variant -> the `Limits` field it sets, and to what
LIMIT_SWITCHES = {"no-prefetch": ("prefetch_depth", 0), "no-growth-estimate": ("growth_from_outputs", False),
                  "no-backfill": ("backfill_wait", 0.0)}


def owner_of(candidates: tuple[str, ...], name: str):
    """The first of `candidates` (modules, or "module:Class") that holds `name`; None when none does
    (the library measured has no such rule)."""
    for candidate in candidates:
        module, _, cls = candidate.partition(":")
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        owner = getattr(owner, cls, None) if cls else owner
        if owner is not None and name in vars(owner):
            return owner
    return None


def available(variant: str) -> bool:
    """Whether the library imported has every switch of `variant` (later versions delete rules)."""
    fields = hf_paged_kv.engine.Limits.__dataclass_fields__
    return (all(owner_of(candidates, name) is not None for candidates, name, _ in SWITCHES.get(variant, []))
            and (variant not in LIMIT_SWITCHES or LIMIT_SWITCHES[variant][0] in fields))


@contextlib.contextmanager
def switched(variant: str):
    """The library's module-level switches of `variant` set, and restored after."""
    changes = []
    for candidates, name, value in SWITCHES.get(variant, []):
        owner = owner_of(candidates, name)
        original = vars(owner)[name]
        changes.append((owner, name, original, value(original) if name == "engine_knobs" else value))
    try:
        for owner, name, _, value in changes:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, original, _ in changes:
            setattr(owner, name, original)


def configured(variant: str, size: dict, slo: SLO) -> tuple[bool, dict, Thresholds]:
    """`(controller, size, thresholds)` of `variant`: what `serve_engine` takes."""
    size = dict(size, limits=dict(size.get("limits", {})), burst_batch_tokens=None)
    thresholds = dict(dwell=size["dwell"], tick=size["tick"])
    if variant == "no-burst":
        size["burst_batch_tokens"] = size["batch_tokens"]
    elif variant in LIMIT_SWITCHES:
        name, value = LIMIT_SWITCHES[variant]
        size["limits"][name] = value
    elif variant == "no-overload":
        thresholds["overload_wait"] = math.inf
    return variant != CORE, size, Thresholds(**thresholds)


# ---------------------------------------------------------------------------------- one run

def overshoot_meter(model) -> dict:
    """Hooks around the stand-in's pacing: how far its forwards ran past their paced length (CPU
    contention: the forward's own compute or the sleep's wake-up came late)."""
    meter = {"forwards": 0, "late": 0, "excess": 0.0}
    started = [0.0]

    def begin(_, args, kwargs):
        started[0] = time.monotonic()

    def end(_, args, kwargs, output):
        target = meter["fixed"] + meter["per_token"] * kwargs["input_ids"].shape[1]
        excess = max(0.0, time.monotonic() - started[0] - target)
        meter["forwards"] += 1
        meter["late"] += excess > 0.005
        meter["excess"] += excess

    model.register_forward_pre_hook(begin, with_kwargs=True)
    model.register_forward_hook(end, with_kwargs=True)  # after the pacing hook: sees its sleep
    return meter


def run_variant(variant: str, trace: str, reqs: list[Req], size: dict, slo: SLO, vocab: int,
                line: tuple[float, float], threads: int = 1) -> dict:
    """One run of `trace` with `variant` on the stand-in, in this process; the figures of the report."""
    torch.set_num_threads(threads)  # runs side by side: each forward is mostly sleep
    controller, size, thresholds = configured(variant, size, slo)
    with switched(variant):
        model = stand_in(vocab, *line)
        meter = overshoot_meter(model)
        meter.update(fixed=line[0], per_token=line[1])
        serve_engine(model, [Req(r.index, r.prompt, r.max_new) for r in reqs[:4]], [], size, "warm-up", controller,
                     slo, thresholds)
        meter.update(forwards=0, late=0, excess=0.0)
        run = serve_engine(model, reqs, [], size, variant, controller, slo, thresholds, size["drain"], size["period"])
    outs = run.outcomes
    done = [o for o in outs if completed(o)]
    end = max((o.last for o in done), default=run.t0)
    makespan = max(end - run.t0, 1e-9)
    within = sum(bench_load.in_slo(o, slo) for o in outs)
    ttft = [o.first - o.arrival for o in done]
    peak = [o.first - o.arrival for r, o in zip(reqs, outs)
            if completed(o) and trace != "steady" and bench_load.at_peak(r, size["minutes"] * 60)]
    high = [(r, o) for r, o in zip(reqs, outs) if r.priority > 0]
    stats = run.extra["stats"]
    return dict(
        variant=variant, trace=trace, within=within, submitted=len(outs), goodput=within / makespan,
        within_high=sum(bench_load.in_slo(o, slo) for _, o in high), high=len(high),
        p99=float(np.percentile(ttft, 99)) if ttft else math.nan,
        p99_peak=float(np.percentile(peak, 99)) if peak else math.nan,
        throughput=sum(len(o.tokens) for o in done) / makespan,
        rejected=sum(1 for o in outs if o.refused or o.attempts > 1), refusals=run.refusals,
        preemptions=run.preemptions, yielded=stats.get("preemptions_for_first_tokens"),
        lost=sum(1 for o in outs if not completed(o) and not o.refused),
        generated_as_asked=all(len(o.tokens) == r.max_new for r, o in zip(reqs, outs) if completed(o)),
        leaked=run.extra["leaked"], forwards=meter["forwards"], late_forwards=meter["late"],
        excess_ms=1e3 * meter["excess"] / max(1, meter["forwards"]),
        library=str(Path(hf_paged_kv.__file__).resolve().parent),
    )


# -------------------------------------------------------------------------------- the traces

def steady_trace(tokenizer, smoke: bool, rate: float) -> tuple[list[Req], dict]:
    """bench_engine's workload at `rate` (its seed for 2/s) and its pool, with bench_load's controller
    timings and drain, and a host tier as large as the pool."""
    size = dict(bench_engine.SMOKE if smoke else bench_engine.FULL)
    base = workload(tokenizer, size)
    static = [blocks_for(len(r.prompt) + r.max_new, size["block_size"]) for r in base]
    size["num_blocks"] = max(math.ceil(size["pool_fraction"] * sum(static)), max(static) + 2)
    size["host_blocks"] = size["num_blocks"]
    timing = bench_load.SMOKE if smoke else bench_load.FULL
    size.update({key: timing[key] for key in ("dwell", "tick", "drain", "period")})
    reqs = poisson(base, rate, seed=STEADY_SEED)
    size["minutes"] = max(r.arrival for r in reqs) / 60
    return reqs, size


def tidal_trace(model, tokenizer, smoke: bool, overload: bool = False) -> tuple[list[Req], dict]:
    """bench_load's trace and pool; `overload`: its rate times `OVERLOAD_RATE`, for `OVERLOAD_MINUTES`
    (the pool sized for the tidal trace's requests, as it is)."""
    size = dict(bench_load.SMOKE if smoke else bench_load.FULL)
    if smoke:
        size.update(SMOKE_TIDAL)
    if overload:
        size.update(rate=size["rate"] * OVERLOAD_RATE, minutes=size["minutes"] if smoke else OVERLOAD_MINUTES)
    reqs = bench_load.build_trace(tokenizer, size, 0)
    bench_load.size_pool(model, reqs, size)
    return reqs, size


def as_generated(model, reqs: list[Req], stop: list[int], size: dict) -> list[Req]:
    """The requests with `max_new` = the tokens the model gives each: per-request greedy generate's,
    computed by the engine (controller off, all at once, a pool that holds them all), whose tokens
    equal it (bench_engine and bench_load check that on every run): much faster than one request at
    a time on a busy machine."""
    whole = dict(size, num_blocks=sum(blocks_for(len(r.prompt) + r.max_new, size["block_size"]) for r in reqs) + 8,
                 host_blocks=None, burst_batch_tokens=None, limits={})
    run = serve_engine(model, poisson(reqs, float("inf"), 0), stop, whole, "lengths")
    if not all(completed(o) for o in run.outcomes):
        raise RuntimeError("a request failed while counting the tokens the model gives each")
    return [Req(r.index, r.prompt, len(o.tokens), r.arrival, r.priority, r.shared, r.group)
            for r, o in zip(reqs, run.outcomes)]


# ---------------------------------------------------------------------------------- the report

def fmt(value, digits: int) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if r[key] is not None and not (isinstance(r[key], float) and math.isnan(r[key]))]
    return statistics.median(values) if values else math.nan


def spread(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if not (isinstance(r[key], float) and math.isnan(r[key]))]
    return max(values) - min(values) if values else math.nan


def moves(runs: list[dict], base: list[dict], figures: dict) -> tuple[list[str], list[str]]:
    """The figures that switching the rule off made worse / better by more than the run-to-run spread
    (the larger of the baseline's and the variant's max - min over repeats)."""
    worse, better = [], []
    for name, (key, sign, digits) in figures.items():
        delta = median(runs, key) - median(base, key)
        if math.isnan(delta):
            continue
        if abs(delta) > max(spread(base, key), spread(runs, key)) and round(abs(delta), digits) > 0:
            (better if sign * delta > 0 else worse).append(f"{name} {delta:+.{digits}f}")
    return worse, better


def verdict(worse: list[str], better: list[str]) -> str:
    if worse and better:
        return "mixed: helps (" + ", ".join(worse) + "), hurts (" + ", ".join(better) + ")"
    if worse:
        return "helps (" + ", ".join(worse) + ")"
    if better:
        return "hurts (" + ", ".join(better) + ")"
    return "no gain"


def trace_table(trace: str, variants: list[str], runs: dict, figures: dict) -> str:
    base = runs[trace, BASELINE]
    header = ["variant", "within SLO, every run", *[f"{n} (Δ)" for n in figures if n != "within SLO"],
              "preemptions", "verdict of the rule"]
    rows = []
    for v in variants:
        rs = runs[trace, v]
        within, change = median(rs, "within"), median(rs, "within") - median(base, "within")
        cells = [v, " / ".join(str(r["within"]) for r in rs) + f" of {rs[0]['submitted']}, median {within:g}"
                 + ("" if v == BASELINE else f" ({change:+g})")]
        for name, (key, _, digits) in figures.items():
            if name == "within SLO":
                continue
            value = median(rs, key)
            cells.append(fmt(value, digits) + ("" if v == BASELINE else f" ({value - median(base, key):+.{digits}f})"))
        cells.append(f"{median(rs, 'preemptions'):g}")
        cells.append("baseline" if v == BASELINE else
                     ("the rules together: " if v == CORE else "") + verdict(*moves(rs, base, figures)))
        rows.append(cells)
    rows.append(["spread of all rules (max - min)", f"{spread(base, 'within'):g}",
                 *[fmt(spread(base, key), digits) for n, (key, _, digits) in figures.items() if n != "within SLO"],
                 f"{spread(base, 'preemptions'):g}", ""])
    return markdown_table(header, rows)


def overall(variants: list[str], runs: dict, traces: dict) -> list[list[str]]:
    """Per rule: the verdict over both traces."""
    rows = []
    for v in variants:
        if v in (BASELINE, CORE):
            continue
        per = {t: moves(runs[t, v], runs[t, BASELINE], figures_of(t)) for t in traces}
        helps = any(w for w, _ in per.values())
        hurts = any(b for _, b in per.values())
        word = "mixed" if helps and hurts else "helps" if helps else "hurts" if hurts else "no gain"
        rows.append([v, VARIANTS[v][0], VARIANTS[v][1], word])
    return rows


def p99_alone(variant: str, runs: dict, traces) -> bool:
    """Whether the figures that `variant` moved beyond the spread, on any trace, are p99s only (some)."""
    moved = [m for t in traces for listed in moves(runs[t, variant], runs[t, BASELINE], figures_of(t))
             for m in listed]
    return bool(moved) and all(m.startswith("p99") for m in moved)


def figures_of(trace: str) -> dict:
    if trace == "overload":
        return FIGURES | HIGH_FIGURE
    return FIGURES if trace == "tidal" else {k: f for k, f in FIGURES.items() if k != "p99 TTFT at the peak s"}


def library_revision() -> str:
    """The commit of the library measured (the tree `hf_paged_kv` is imported from; +dirty with
    uncommitted changes there)."""
    where = Path(hf_paged_kv.__file__).resolve().parent.parent

    def git(*args):
        return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", "hf_paged_kv") else "")


# -------------------------------------------------------------------------------------- main

def measure(args, variants: list[str]) -> dict:
    """Every run of the ablation; what the report needs (JSON-able: `--results` keeps it)."""
    measured = library_revision()
    note(f"loading {model_name(args.smoke)} (library from {Path(hf_paged_kv.__file__).parent}, {measured})")
    model, tokenizer = load(args.smoke)
    stop = stop_ids(model, tokenizer)
    traces, slos, sizes = {}, {}, {}
    for trace in args.traces:
        reqs, size = (steady_trace(tokenizer, args.smoke, args.steady_rate) if trace == "steady"
                      else tidal_trace(model, tokenizer, args.smoke, overload=trace == "overload"))
        note(f"{trace}: the tokens {model_name(args.smoke)} gives each request (per-request greedy, on the engine)")
        traces[trace], sizes[trace] = as_generated(model, reqs, stop, size), size
    first = traces[args.traces[0]]
    batch_tokens = sizes[args.traces[0]]["batch_tokens"]
    sizes_timed = sorted({1, batch_tokens // 8, batch_tokens // 2, batch_tokens})
    line = tuple(args.line) if args.line else forward_line(lambda n: model_alone(model, first, 0, [(n, 1)]),
                                                           sizes_timed)
    for trace in args.traces:
        given = getattr(args, f"slo_{trace}")
        if given:
            slos[trace] = SLO(*given)
        else:  # bench_load's calibration, on the stand-in the runs use: the paced line's times, not the load's
            note(f"{trace}: calibrating the SLO targets on the stand-in")
            torch.set_num_threads(1)
            stand = stand_in(model.config.vocab_size, *line)
            slos[trace] = SLO(*bench_load.calibrated_targets(bench_load.calibrate(stand, traces[trace], [],
                                                                                  sizes[trace])))
    note(f"forwards paced to {line[0] * 1e3:.0f} ms + {line[1] * 1e3:.2f} ms x n; SLOs "
         + ", ".join(f"{t} {s.ttft:g} / {s.per_token:g} s" for t, s in slos.items()))
    vocab = model.config.vocab_size
    # alternating: every repeat runs every variant on every trace, the variants' order rotated by one
    jobs = [(v, t) for k in range(args.repeats) for v in variants[k % len(variants):] + variants[:k % len(variants)]
            for t in args.traces]
    started = time.monotonic()
    if args.parallel <= 1:  # in this process, one after another: the switches are restored after each run
        results = [run_variant(v, t, traces[t], sizes[t], slos[t], vocab, line, torch.get_num_threads())
                   for v, t in jobs]
    else:
        note(f"{len(jobs)} runs, {args.parallel} at a time")
        context = multiprocessing.get_context("spawn")
        # a fresh process per run: a variant's switches must not carry into the next run
        with ProcessPoolExecutor(args.parallel, mp_context=context, max_tasks_per_child=1) as pool:
            futures = [pool.submit(run_variant, v, t, traces[t], sizes[t], slos[t], vocab, line) for v, t in jobs]
            results = []
            for (v, t), future in zip(jobs, futures):
                try:
                    r = future.result()
                except Exception as error:  # noqa: BLE001 - one failed run is reported, the others kept
                    note(f"FAILED: {t}, {v}: {error!r}")
                    results.append(dict(variant=v, trace=t, failed=repr(error)))
                    continue
                results.append(r)
                note(f"done {len(results)}/{len(jobs)}: {t}, {v}: {r['within']} of {r['submitted']} within, p99 "
                     f"TTFT {r['p99']:.2f} s, {r['late_forwards']} of {r['forwards']} forwards past their pace")
    return dict(argv=sys.argv[1:], measured=measured, library=str(Path(hf_paged_kv.__file__).resolve().parent),
                results=results,
                jobs=len(jobs), minutes=(time.monotonic() - started) / 60,
                line=list(line), line_given=bool(args.line), counts={t: len(traces[t]) for t in traces},
                slos={t: [s.ttft, s.per_token] for t, s in slos.items()},
                slos_given={t: bool(getattr(args, f"slo_{t}")) for t in slos},
                sizes={t: {k: v for k, v in s.items() if isinstance(v, (int, float, str, list, tuple, dict))}
                       for t, s in sizes.items()})


def report(args, variants: list[str], data: dict) -> tuple[str, Checks]:
    checks = Checks()
    failed = [r for r in data["results"] if "failed" in r]
    checks.expect(not failed, f"{len(failed)} runs failed: " + "; ".join(f"{r['trace']}, {r['variant']}: {r['failed']}"
                                                                        for r in failed[:4]))
    results = [r for r in data["results"] if "failed" not in r]
    traces = list(data["sizes"])
    runs = {(t, v): [r for r in results if (r["trace"], r["variant"]) == (t, v)] for t in traces for v in variants}
    for (t, v), rs in runs.items():
        checks.expect(bool(rs), f"{t}, {v}: no run")
        checks.expect(all(r["lost"] == 0 and r["leaked"] == 0 for r in rs),
                      f"{t}, {v}: a request lost or a block leaked")
        checks.expect(all(r["generated_as_asked"] for r in rs),
                      f"{t}, {v}: a request generated another number of tokens")
    checks.expect(all(r["library"] == data["library"] for r in results), "a run imported hf_paged_kv from elsewhere")
    variants = [v for v in variants if all(runs[t, v] for t in traces)]
    late = sum(r["late_forwards"] for r in results) / max(1, sum(r["forwards"] for r in results))
    excess = statistics.fmean(r["excess_ms"] for r in results) if results else math.nan
    line, sizes, counts = data["line"], data["sizes"], data["counts"]
    slos = {t: SLO(*s) for t, s in data["slos"].items()}
    names = {"tidal": "Tidal trace", "steady": "Steady mixed workload", "overload": "Overload trace"}
    describe = {
        "tidal": lambda s, n: (f"bench_load's trace (seed 0, {n} requests over {s['minutes'] * 60:.0f} s, pool "
                               f"{s['num_blocks']} blocks of {s['block_size']}, host tier as many, "
                               f"`max_batch_tokens={s['batch_tokens']}`, `max_running={s['max_running']}`)"),
        "overload": lambda s, n: (f"the tidal trace's requests (seed 0) at {OVERLOAD_RATE:g} times its rate: {n} "
                                  f"over {s['minutes'] * 60:.0f} s, {s['rate']:.1f}/s on average, a quarter of "
                                  f"them priority 1; the tidal trace's pool ({s['num_blocks']} blocks of "
                                  f"{s['block_size']}, host tier as many) and limits"),
        "steady": lambda s, n: (f"bench_engine's {n} requests, Poisson arrivals at {args.steady_rate:g}/s over "
                                f"{s['minutes'] * 60:.0f} s, pool {s['num_blocks']} blocks of {s['block_size']}, host "
                                f"tier as many, `max_batch_tokens={s['batch_tokens']}`, "
                                f"`max_running={s['max_running']}`"),
    }
    which = "overload rules" if traces == ["overload"] else "scheduling rules"
    parts = [f"### Ablation of the {which} ({model_name(args.smoke)}'s forward times, stand-in model)", "",
             "Each rule beyond the core switched off alone, against the engine with all of them (controller on, SLO "
             "targets) and with the core alone (controller off, no targets; `Limits`' other defaults kept). A verdict counts a figure whose median moved by more than the run-to-run "
             "spread (the larger max - min over repeats of the two rows): helps = switching the rule off made it "
             "worse.", ""]
    for t in traces:
        s, slo = sizes[t], slos[t]
        how = "given" if data.get("slos_given", {}).get(t) else "calibrated on the stand-in as bench_load does"
        parts += [f"**{names[t]}**: {describe[t](s, counts[t])}; SLO {slo.ttft:g} s to the first token, "
                  f"{slo.per_token:g} s per token ({how}).", "",
                  trace_table(t, variants, runs, figures_of(t)), ""]
    parts += ["**Verdicts** (helps: a figure worse without the rule on either trace; hurts: one better, none "
              "worse):", "", markdown_table(["variant", "switched off", "how", "verdict"],
                                            overall(variants, runs, traces)), ""]
    p99_only = [v for v in variants if v not in (BASELINE, CORE) and p99_alone(v, runs, traces)]
    if p99_only:
        parts += ["Verdicts that rest on p99 time to first token alone (no count within the SLO, goodput, "
                  f"throughput or rejection moved beyond the spread): {', '.join(p99_only)}.", ""]
    if args.missing:
        parts += [f"Not run, the library measured has no such rule: {', '.join(args.missing)}.", ""]
    side = ("one after another in one process, the switches restored after each run" if args.parallel <= 1 else
            f"{args.parallel} runs side by side, each in a process of its own")
    parts += [f"Method: forwards paced to {line[0] * 1e3:.0f} ms + {line[1] * 1e3:.2f} ms x n ("
              f"{'given' if data.get('line_given') else 'measured here: the model alone'}), each request generating "
              f"as many tokens as {model_name(args.smoke)} gives it; "
              f"{args.repeats} repeat{'s' if args.repeats > 1 else ''}, every variant on both traces in each, the order rotated per repeat; "
              f"{side}, after an untimed warm-up of 4 requests; medians. Goodput and tokens/s are over the makespan "
              f"(first arrival to last token); rejected: requests refused at least once; TTFT from the submission.",
              "",
              f"Contention check: {100 * late:.1f}% of forwards ran more than 5 ms past their pace (mean excess "
              f"{excess:.1f} ms); the {data['jobs']} runs took {data['minutes']:.0f} min. Library measured: "
              f"{data['measured']} (`PYTHONPATH` at its worktree); a switch not in `Limits` is a library constant or "
              f"function replaced in the run's process."]
    return "\n".join(parts), checks


def main() -> int:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--traces", nargs="+", choices=TRACES, default=list(DEFAULT_TRACES),
                        help="the overload trace alone writes a section of its own (ablation-overload)")
    parser.add_argument("--parallel", type=int,
                        help="runs side by side, each its own process (default 4; 1 in --smoke: in this process)")
    parser.add_argument("--steady-rate", type=float,
                        help=f"arrivals/s of the steady workload (default {STEADY_RATE:g})")
    for trace in TRACES:
        parser.add_argument(f"--slo-{trace}", type=float, nargs=2, metavar=("TTFT", "PER_TOKEN"),
                            help=f"the {trace} trace's SLO targets, s (default: calibrated)")
    parser.add_argument("--line", type=float, nargs=2, metavar=("FIXED", "PER_TOKEN"),
                        help="the forward-time line the stand-in is paced to, s and s/token (default: measured)")
    parser.add_argument("--results", help="a JSON file: where the runs' figures are kept (with --report-from: read)")
    parser.add_argument("--report-from", action="store_true", help="rebuild the report from --results, running nothing")
    args = parser.parse_args()
    data = None
    if args.report_from:  # the report of a measured run: its options, and the section names its command
        data = json.loads(Path(args.results).read_text())
        if "argv" in data:
            sys.argv[1:] = data["argv"]
            args = parser.parse_args(data["argv"])
    if args.smoke:
        args.repeats = min(args.repeats, 1)
    common.check_repeats(args)
    args.parallel = args.parallel or (1 if args.smoke else 4)
    args.steady_rate = args.steady_rate or (SMOKE_STEADY_RATE if args.smoke else STEADY_RATE)
    asked = [BASELINE] + [v for v in args.variants if v != BASELINE]
    variants = [v for v in asked if available(v)]
    args.missing = [v for v in asked if v not in variants]  # rules this library no longer has
    if data is None:
        data = measure(args, variants)
        if args.results:
            Path(args.results).write_text(json.dumps(data))
    common.REVISION = data["measured"]  # the section's stamp: the library measured, not the bench scripts' tree
    body, checks = report(args, variants, data)
    if args.traces == ["overload"]:
        return checks.finish("ablation-overload", body, args.smoke, after="ablation")
    return checks.finish("ablation", body, args.smoke, after="emulated-load-targets")


if __name__ == "__main__":
    sys.exit(main())
