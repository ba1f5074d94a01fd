"""A tidal load on SmolLM2-135M (fp32; CPU, or CUDA when there is one): the engine with its load
controller, without it, and transformers' continuous batching, on the same seeded trace at the same
KV memory.

    python bench/bench_load.py                              # 3 minutes of trace per system (CPU rates)
    python bench/bench_load.py --minutes 10 --rate 40 --pool-requests 200   # e.g. on a GPU
    python bench/bench_load.py --smoke                      # tiny random Llama, a few seconds, prints only

The trace (seeded): arrivals over `--minutes` whose rate follows a slow tide, `rate * (1 - 0.5 *
cos(2 pi t / T))` – a trough of rate/2 at both ends and a peak of 1.5 x rate in the middle, a 3x
swing, mean `--rate` requests/s – with bursts on top: the gaps are gamma-distributed with shape
`--burst-shape` (< 1: clustered arrivals; coefficient of variation 1/sqrt(shape)), drawn in the
tide's own time scale (a time-rescaled gamma renewal process). Requests are real text
(`common.real_text`) of mixed lengths: some share one of two system prompts, some continue a
conversation (its whole history resent, the previous turns a shared prefix), the rest stand
alone; a quarter are priority 1 (interactive), the rest priority 0 (batch). Each stops at the end
of its first sentence or at its own max_new_tokens.

Systems, one after another, each serving the whole trace in real time: the engine with the
controller (`controller=True`), the engine without it, and transformers' `ContinuousBatchingManager`
(streaming, the same `num_blocks` / `block_size` / `max_batch_tokens`: the same KV bytes). The pool
holds the static reservation (prompt + max_new_tokens) of `--pool-requests` average requests:
fewer than are in flight at the peak. Both engines also get a host tier of as many blocks
(`--host-blocks`), where evicted prefixes go; transformers CB gets a CPU swap pool of the same bytes
where it can have one (it pins it, which needs an accelerator). On a CPU-only machine the host
tier is the same RAM as the pool: there the engines hold up to twice transformers CB's KV bytes
(the report gives the host tier's peak; `--host-blocks 0` compares at equal bytes), plus the
partial last block of each preempted request, which waits in host memory outside the tier. The client honours `retry_after`: a refused request (at
submit, or turned away while waiting) is resubmitted after it, up to 8 attempts while the trace
plus `--drain` seconds last; requests not done by then are cancelled and counted as lost.

SLO targets (used by the controller, and for availability): unless given with `--slo-ttft` /
`--slo-per-token`, calibrated on this machine before the runs: time to first token = 5 x the median
time to first token of a request served alone, per-token latency = 3 x the median per-token latency
of 8 requests decoding together (room for prefill chunks sharing their forwards).

Reported per system: availability (requests completed within both targets, time to first token
counted from the first submission, / requests submitted), goodput, p50/p95/p99 time to first token
and per-token latency overall and at the peak (requests arriving in the middle third of the trace),
refusals, retries, lost requests, preemptions, peak KV, concurrency; a plot of load, queue, KV usage,
controller state and latency over time. And what this machine allows any schedule: an upper bound
on availability from the model's own forward times on this trace (`feasibility.py`), the
tightest time-to-first-token target at which that bound reaches 99.5%, and lower bounds on the
p50/p95/p99 time to first token at the peak.
"""

from __future__ import annotations

import math
import statistics
import sys

import common
import numpy as np
import torch
from bench_engine import (
    Req,
    Run,
    blocks_for,
    completed,
    device_name,
    fmt,
    load_pair,
    log_uniform,
    mib,
    model_alone,
    pct,
    per_token,
    pick_device,
    poisson,
    serve_cb,
    serve_engine,
    serve_generate,
)
from common import Checks, arguments, markdown_table, model_name, note, prompts_of_lengths
from feasibility import forward_line, most_in_time, ttft_floors, uncached_tokens

import hf_paged_kv
from hf_paged_kv import Engine, KVPool
from hf_paged_kv.engine import SLO, Limits, Thresholds

FULL = dict(minutes=3.0, rate=0.7, burst_shape=0.25, system_tokens=(160, 96), prompt=(24, 256), question=(12, 48),
            conversation=(48, 96), turn=(12, 40), new=(16, 48), block_size=16, pool_requests=6, batch_tokens=256,
            max_running=32, drain=120.0, period=0.5, dwell=5.0, tick=0.5)
SMOKE = dict(minutes=0.08, rate=8.0, burst_shape=0.25, system_tokens=(20, 12), prompt=(6, 30), question=(3, 8),
             conversation=(8, 12), turn=(3, 6), new=(4, 10), block_size=8, pool_requests=3, batch_tokens=48,
             max_running=2, drain=20.0, period=0.1, dwell=0.3, tick=0.1)
SHARES = dict(system=0.4, conversation=0.2)  # the rest stand alone
HIGH_PRIORITY = 0.25
MAX_TURNS = 6


# --------------------------------------------------------------------------------- the trace

def tide(t, rate: float, duration: float):
    return rate * (1 - 0.5 * np.cos(2 * np.pi * np.asarray(t) / duration))


def tidal_arrivals(minutes: float, rate: float, shape: float, seed: int) -> np.ndarray:
    """Arrival times (s): a gamma renewal process of mean gap 1, mapped through the inverse of
    the tide's cumulative rate (so the local mean rate follows the tide and bursts stay)."""
    duration = minutes * 60
    grid = np.linspace(0, duration, 20_001)
    cumulative = rate * (grid - 0.5 * duration / (2 * np.pi) * np.sin(2 * np.pi * grid / duration))
    rng = np.random.default_rng(seed)
    expected = int(rate * duration * 1.5) + 32
    steps = np.cumsum(rng.gamma(shape, 1 / shape, expected))
    steps = steps[steps < cumulative[-1]]
    return np.interp(steps, cumulative, grid)


def build_trace(tokenizer, size: dict, seed: int = 0) -> list[Req]:
    times = tidal_arrivals(size["minutes"], size["rate"], size["burst_shape"], seed)
    n = len(times)
    rng = np.random.default_rng(seed + 1)
    systems = [prompts_of_lengths(tokenizer, [length], seed=seed + 200 + k)[0]
               for k, length in enumerate(size["system_tokens"])]
    plain = prompts_of_lengths(tokenizer, log_uniform(rng, *size["prompt"], n), seed=seed + 300)
    questions = prompts_of_lengths(tokenizer, log_uniform(rng, *size["question"], n), seed=seed + 301)
    turns = prompts_of_lengths(tokenizer, log_uniform(rng, *size["turn"], 2 * n), seed=seed + 302)
    openings = prompts_of_lengths(tokenizer, log_uniform(rng, *size["conversation"], n), seed=seed + 303)
    news = rng.integers(size["new"][0], size["new"][1] + 1, n)
    kinds = rng.choice(["system", "conversation", "plain"], n,
                       p=[SHARES["system"], SHARES["conversation"], 1 - sum(SHARES.values())])
    priorities = (rng.random(n) < HIGH_PRIORITY).astype(int)
    conversations: list[dict] = []  # open conversations: history so far, turns taken
    reqs, turn_cursor = [], 0
    for i, t in enumerate(times):
        if kinds[i] == "system":
            k = int(rng.integers(len(systems)))
            prompt, shared, group = systems[k] + questions[i], len(systems[k]), f"system{k}"
        elif kinds[i] == "conversation":
            open_ = [c for c in conversations if c["turns"] < MAX_TURNS]
            if not open_ or rng.random() < 0.3:  # a new conversation starts
                conversations.append({"history": list(openings[i]), "turns": 0, "id": len(conversations)})
                open_ = [conversations[-1]]
            c = open_[int(rng.integers(len(open_)))]
            shared = len(c["history"]) if c["turns"] else 0
            prompt, group = c["history"] + turns[turn_cursor], f"conversation{c['id']}"
            # the next turn resends this one and a reply (real text standing in for the model's answer)
            c["history"] = prompt + turns[turn_cursor + 1]
            c["turns"] += 1
            turn_cursor += 2
        else:
            prompt, shared, group = plain[i], 0, ""
        reqs.append(Req(i, prompt, int(news[i]), float(t), int(priorities[i]), shared, group))
    return reqs


def size_pool(model, reqs: list[Req], size: dict, host_blocks: int | None = None) -> None:
    """Set the pool's `num_blocks` (the static reservation of `pool_requests` average requests, and
    room for the largest), its `per_block` bytes and the engines' `host_blocks` (default: as many
    as the pool; 0: none) in `size`."""
    bs = size["block_size"]
    mean_static = statistics.mean(blocks_for(len(r.prompt) + r.max_new, bs) for r in reqs)
    size["num_blocks"] = max(math.ceil(size["pool_requests"] * mean_static),
                             max(blocks_for(len(r.prompt) + r.max_new, bs) for r in reqs) + 2)
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=size["num_blocks"], block_size=bs))
    size["per_block"] = hf_paged_kv.pool_of(model).bytes_per_block
    hf_paged_kv.disable(model)
    size["host_blocks"] = size["num_blocks"] if host_blocks is None else (host_blocks or None)


def at_peak(r: Req, duration: float) -> bool:
    """Whether `r` arrives in the middle third of the trace, around the tide's peak."""
    return duration / 3 <= r.arrival < 2 * duration / 3


# ------------------------------------------------------------------------------ calibration

def calibrate(model, reqs: list[Req], stop: list[int], size: dict) -> dict:
    """Time to first token of typical requests served alone, and per-token latency of 8 requests
    decoding together, on the engine (also its warm-up)."""
    typical = sorted(reqs, key=lambda r: len(r.prompt))[len(reqs) // 4: 3 * len(reqs) // 4] or reqs
    picks = [typical[i * len(typical) // 8] for i in range(8)]
    hf_paged_kv.disable(model)
    needed = sum(blocks_for(len(r.prompt) + size["new"][1], size["block_size"]) for r in picks) + 8
    pool = KVPool(num_blocks=max(size["num_blocks"], needed), block_size=size["block_size"])
    engine = Engine(model, pool=pool, controller=False,
                    limits=Limits(max_running=size["max_running"], max_batch_tokens=size["batch_tokens"]))
    alone, together = [], []
    with engine:
        engine.submit(picks[0].prompt, max_new_tokens=4, eos_token_id=stop).result()  # warm-up
        for r in picks[:4]:
            handle = engine.submit(r.prompt, max_new_tokens=2, eos_token_id=[])
            handle.result()
            alone.append(handle.request.first_token - handle.request.arrived)
        handles = [engine.submit(r.prompt, max_new_tokens=size["new"][1], eos_token_id=[]) for r in picks]
        for handle in handles:
            handle.result()
            request = handle.request
            together.append((request.last_token - request.first_token) / max(1, len(request.generated) - 1))
    hf_paged_kv.disable(model)
    return dict(ttft_alone=statistics.median(alone), per_token_together=statistics.median(together))


def calibrated_targets(calibration: dict) -> tuple[float, float]:
    """`(ttft, per_token)` targets from `calibrate`: 5 x the time to first token alone, 3 x the
    per-token latency of 8 requests decoding together (room for prefill chunks in their forwards)."""
    return round2(5 * calibration["ttft_alone"]), round2(3 * calibration["per_token_together"])


def machine_bound(plain, reqs: list[Req], ttft: float, batch_tokens: int, duration: float) -> dict:
    """What any schedule could do on this machine (`feasibility`): the line under the model's
    forward times, the most requests whose first token can come within `ttft`, the least
    time-to-first-token target (within 2%) for which the bound reaches 99.5%, and lower bounds on
    the p50/p95/p99 time to first token of the requests arriving at the peak."""
    sizes = sorted({1, batch_tokens // 8, batch_tokens // 2, batch_tokens})
    fixed, per_token = forward_line(lambda n: model_alone(plain, reqs, 0, [(n, 1)]), sizes)
    prompts, arrivals = [r.prompt for r in reqs], [r.arrival for r in reqs]
    everyone = range(len(reqs))
    peak = [i for i in everyone if at_peak(reqs[i], duration)]

    def in_time(target: float, among=everyone) -> int:
        """The most requests of `among` in time at `target` (others left out: that only loosens it),
        each computing the prompt tokens it shares with no request, of `among` or not, in time."""
        uncached = uncached_tokens(prompts, arrivals, target)
        return most_in_time([arrivals[i] for i in among], [per_token * uncached[i] for i in among], target, fixed)

    most = in_time(ttft)
    enough = math.ceil(0.995 * len(reqs))
    low, high, reached = 0.0, ttft, most
    while reached < enough:
        low, high = high, 2 * high
        reached = in_time(high)
    while high - low > 0.02 * high:
        middle = (low + high) / 2
        low, high = (low, middle) if in_time(middle) >= enough else (middle, high)
    return dict(fixed=fixed, per_token=per_token, sizes=sizes, most=most,
                tokens=sum(uncached_tokens(prompts, arrivals, ttft)), short_ttft=low, enough_ttft=high,
                peak_floors=ttft_floors(lambda target: in_time(target, peak), len(peak), fixed + per_token))


def round2(x: float) -> float:
    """Two significant digits."""
    return float(f"{x:.2g}")


# ------------------------------------------------------------------------------- the report

def in_slo(o, slo: SLO) -> bool:
    if not completed(o):
        return False
    tok = per_token(o)
    return o.first - o.arrival <= slo.ttft and (tok is None or tok <= slo.per_token)


def summarize(run: Run, reqs: list[Req], slo: SLO, duration: float, reference: list[list[int]]) -> dict:
    peak = [at_peak(r, duration) for r in reqs]
    outs = run.outcomes
    done = [o for o in outs if completed(o)]
    mismatched = [r.index for r, o, tokens in zip(reqs, outs, reference) if completed(o) and o.tokens != tokens]
    done_at_peak = [o for o, p in zip(outs, peak) if p and completed(o)]

    def ttft(os):
        return [o.first - o.arrival for o in os]

    def tok(os):
        return [x for o in os if (x := per_token(o)) is not None]

    within = sum(in_slo(o, slo) for o in outs)
    t0 = run.t0
    samples = [s for s in run.samples if s[0] >= t0]
    kv_total = run.extra.get("kv_total") or 1
    return dict(
        submitted=len(outs), completed=len(done), completed_peak=len(done_at_peak), within=within,
        mismatched=mismatched,
        availability=within / len(outs),
        availability_peak=sum(in_slo(o, slo) for o, p in zip(outs, peak) if p) / max(1, sum(peak)),
        high_availability=(sum(in_slo(o, slo) for o in outs if o.priority == 1)
                           / max(1, sum(1 for o in outs if o.priority == 1))),
        goodput=within / duration,
        ttft=[pct(ttft(done), q) for q in (50, 95, 99)], ttft_peak=[pct(ttft(done_at_peak), q) for q in (50, 95, 99)],
        tok=[pct(tok(done), q) for q in (50, 95, 99)], tok_peak=[pct(tok(done_at_peak), q) for q in (50, 95, 99)],
        refused=sum(1 for o in outs if o.refused), refusals=run.refusals, retries=run.retries,
        lost=sum(1 for o in outs if not completed(o) and not o.refused),
        preemptions=run.preemptions, peak_kv=run.peak_kv, peak_kv_share=run.peak_kv / kv_total,
        max_running=run.max_running if run.max_running is not None else max((s[1] for s in samples), default=0),
        mean_running=float(np.mean([s[1] for s in samples])) if samples else 0.0,
        max_waiting=max((s[2] for s in samples), default=0),
        inherited=run.extra.get("stats", {}).get("tokens_inherited"),
        peak_host=max((s[4]["host_bytes"] for s in samples if "host_bytes" in s[4]), default=None),
    )


def three(values, digits=2) -> str:
    return " / ".join(fmt(v, digits) for v in values)


def report(args, size, reqs, slo, how, names, summaries, calibration, every_run, bound, image: str = "") -> str:
    """The section's text; `image`: the plot's markdown link, set next to the tables it draws."""
    duration = size["minutes"] * 60
    n = len(reqs)
    kinds = {k: sum(1 for r in reqs if r.group.startswith(k)) for k in ("system", "conversation")}
    lines = [
        f"### Tidal load: the load controller ({model_name(args.smoke)}, fp32, "
        f"{device_name(pick_device(args.device))})",
        "",
        f"Trace (seed {args.seed}): {n} requests over {duration:.0f} s, arrival rate `{size['rate']:g} * (1 - 0.5 * "
        f"cos(2 pi t / {duration:.0f} s))` per second (trough {size['rate'] / 2:g}/s, peak {1.5 * size['rate']:g}/s: "
        f"a 3x swing) with bursts (gamma-distributed gaps, shape {size['burst_shape']}); prompts of "
        f"{min(len(r.prompt) for r in reqs)}..{max(len(r.prompt) for r in reqs)} tokens of real text, "
        f"{kinds['system']} sharing one of two system prompts, {kinds['conversation']} continuing a conversation "
        "(history resent), "
        f"{sum(r.priority for r in reqs)} of priority 1; max_new_tokens {size['new'][0]}..{size['new'][1]}, "
        f"stopping at the end of the first sentence.",
        "",
        f"KV memory for every system: {size['num_blocks']} blocks of "
        f"{size['block_size']} tokens ({mib(size['num_blocks'] * size['per_block'])} MiB, the static reservation of "
        f"{size['pool_requests']} average requests). {host_text(size)} Engine: `max_running={size['max_running']}, "
        f"max_batch_tokens="
        f"{size['batch_tokens']}`, `Thresholds(dwell={size['dwell']}, tick={size['tick']})`; transformers CB: "
        f"`ContinuousBatchingConfig(num_blocks={size['num_blocks']}, block_size={size['block_size']}, "
        f"max_batch_tokens={size['batch_tokens']})`.",
        "",
        f"SLO targets: time to first token {slo.ttft:g} s, per-token latency {slo.per_token:g} s ({how}).",
    ]
    header = ["system", "availability (peak)", "priority 1 availability", "goodput req/s", "completed",
              "refused (gave up)", "refusals / retries", "lost", "preemptions",
              "peak KV MiB (share)", "peak host tier MiB", "max / mean running", "max waiting",
              "same tokens as per-request generate"]
    rows = []
    for name in names:
        s = summaries[name]
        rows.append([name, f"{s['availability']:.1%} ({s['availability_peak']:.1%})", f"{s['high_availability']:.1%}",
                     f"{s['goodput']:.3f}", f"{s['completed']} of {s['submitted']}", s["refused"],
                     f"{s['refusals']} / {s['retries']}", s["lost"],
                     "-" if s["preemptions"] is None else str(s["preemptions"]),
                     f"{mib(s['peak_kv'])} ({s['peak_kv_share']:.0%})",
                     "-" if s["peak_host"] is None else mib(s["peak_host"]), f"{s['max_running']:.0f} / "
                     f"{s['mean_running']:.1f}", f"{s['max_waiting']:.0f}",
                     "yes" if not s["mismatched"] else f"NO: {len(s['mismatched'])} of {s['completed']}"])
    lines += ["", "**Service** (availability: requests completed within both targets / requests submitted; time to "
                  "first token counted from the first submission, retries included):", "",
              markdown_table(header, rows)]
    header = ["system", "TTFT p50 / p95 / p99 s", "TTFT at peak p50 / p95 / p99 s", "per-token p50 / p95 / p99 s",
              "per-token at peak p50 / p95 / p99 s"]
    rows = [[name, three(summaries[name]["ttft"]), three(summaries[name]["ttft_peak"]),
             three(summaries[name]["tok"], 3), three(summaries[name]["tok_peak"], 3)] for name in names]
    lines += ["", "**Latency** (over completed requests; at peak: those arriving in the middle third of the trace):",
              "", markdown_table(header, rows)]
    if image:
        lines += ["", image]
    on, off = summaries[names[0]], summaries[names[1]]
    p99_on, p99_off = on["ttft_peak"][2], off["ttft_peak"][2]
    rows = [
        ["every request completes or is refused with retry_after (0 lost)", f"{on['lost']} lost", "0 lost",
         "yes" if on["lost"] == 0 else "NO"],
        ["availability within targets", f"{on['availability']:.1%} (without: {off['availability']:.1%})",
         ">= 99.5 % and better than without", "yes" if on["availability"] >= 0.995 and
         on["availability"] > off["availability"] else "NO"],
        ["p99 time to first token at the peak", f"{fmt(p99_on)} s (without: {fmt(p99_off)} s)",
         "<= half of without", "yes" if p99_on <= 0.5 * p99_off else "NO"],
    ]
    lines += ["", "**Targets** (the engine with the controller):", "",
              markdown_table(["target", "measured", "wanted", "met"], rows)]
    lines += ["", bound_text(reqs, slo, bound, 0.5 * p99_off, on["completed_peak"])]
    if calibration:
        lines += ["", f"Calibration on this machine: time to first token alone {calibration['ttft_alone']:.3f} s "
                      f"(median of 4 typical requests served one at a time), per-token latency of 8 requests decoding "
                      f"together {calibration['per_token_together']:.3f} s (median)."]
    if args.repeats > 1:
        lines += ["", "Availability of every run, in the order run: " + "; ".join(
            f"{name} {' / '.join(f'{a:.1%}' for a in every_run[name])}" for name in names) + "."]
    runs = f"{args.repeats} runs" if args.repeats > 1 else "one run"
    lines += ["", f"Method: {runs} of each system over the same seeded trace in real time (the order rotated per "
                  f"repeat; figures of the "
                  f"{'median run by availability' if args.repeats > 1 else 'run'}), after an untimed warm-up of each "
                  "(4 requests; and the calibration, when it ran, on the engine); client and servers in one process "
                  f"on this machine ({torch.get_num_threads()} torch threads).", "",
              "- The tokens of every completed request are compared with per-request greedy `generate` "
              "(DynamicCache, untimed); a difference in either engine fails the run.",
              f"- Queue, running sequences and KV usage are sampled every {size['period']} s.",
              "- Time to first token counts from the request's first submission; per-token latency is per request "
              "(last - first token) / (tokens - 1); percentiles are over requests.",
              "- Both engines and transformers CB start with the client thread's idle OpenMP workers released "
              "(`hf_paged_kv.engine.openmp`)."]
    return "\n".join(lines)


def host_text(size: dict) -> str:
    """What each system may swap to beyond its KV memory."""
    if not size["host_blocks"]:
        return "No host tier."
    host = f"{size['host_blocks']} blocks ({mib(size['host_blocks'] * size['per_block'])} MiB)"
    cb = (f"transformers CB a CPU swap pool of the same bytes (`cpu_offload_space={size['cb_offload_gib']:.4f}` GiB)"
          if size["cb_offload_gib"] else "transformers CB none: its CPU swap pool is pinned memory, which a torch "
          "without an accelerator cannot allocate")
    return f"Host memory to swap to: both engines a host tier of {host} (where evicted prefixes go), {cb}."


def bound_text(reqs: list[Req], slo: SLO, bound: dict, p99_wanted: float, served: int) -> str:
    """The bound's paragraph; `p99_wanted`: the p99 time to first token at the peak the target asks
    for; `served`: how many requests of the peak the controlled engine completed."""
    n = len(reqs)
    floor_pct = math.floor(1000 * bound["most"] / n) / 10
    text = (f"**What this machine allows** (an upper bound for any schedule, `bench/feasibility.py`): here a forward "
            f"of the model alone over n tokens took at least {bound['fixed'] * 1e3:.0f} ms + "
            f"{bound['per_token'] * 1e3:.2f} ms x n (a line under the medians of 5 timings at n = "
            f"{', '.join(map(str, bound['sizes']))}). With forwards costing no less than that line, only the prompt "
            f"tokens that no other request arriving before the deadline shares counted ({bound['tokens']} of "
            f"{sum(len(r.prompt) for r in reqs)}), and decoding and everything but the model free, no schedule gives "
            f"more than {bound['most']} of the {n} requests their first token within {slo.ttft:g} s: availability "
            f"at most {floor_pct:.1f}% on this trace at this machine's speed. The bound first allows 99.5% at a "
            f"time-to-first-token target between {bound['short_ttft']:.3g} s and {bound['enough_ttft']:.3g} s "
            f"(about {bound['enough_ttft'] / slo.ttft:.2g}x this run's).")
    floors = bound["peak_floors"]
    if not floors:
        return text
    p50, p95, p99 = (math.floor(100 * pct(floors, q)) / 100 for q in (50, 95, 99))  # rounded down, the safe side
    text += (f"\n\nLatency at the peak, under the same bound: if at most k - 1 of the {len(floors)} requests arriving "
             f"in the middle third can have their first token within a target, the k-th fastest first token among "
             f"them takes longer than that target, so any schedule that serves them all has p50 / p95 / p99 time to "
             f"first token at the peak of at least {p50:.2f} / {p95:.2f} / {p99:.2f} s.")
    if not served or math.isnan(p99_wanted):
        return text
    # a schedule that serves only some of them: its i-th fastest is still no faster than the i-th floor
    least = math.floor(100 * pct(floors[:served], 99)) / 100
    which = "all of them" if served == len(floors) else f"{served} of them"
    if least > p99_wanted:
        verdict = (f"above half the uncontrolled engine's ({p99_wanted:.3f} s): the target is out of this machine's "
                   f"reach on this trace at this speed for any schedule that completes as many")
    else:
        verdict = (f"not above half the uncontrolled engine's ({p99_wanted:.3f} s): the bound does not rule the "
                   "target out")
    return text + (f" The controlled engine completed {which}; over as many, no schedule's p99 is below {least:.2f} s, "
                   f"{verdict}.")


def plot(args, size, reqs, slo, names, runs) -> str:
    """Load, queue, KV usage, controller state and latency over time (docs/bench_load.png; a temp
    dir in smoke runs)."""
    path = common.plot_path(args, "bench_load")
    import matplotlib.pyplot as plt
    duration = size["minutes"] * 60
    fig, axes = plt.subplots(6, 1, figsize=(9, 13), sharex=True)
    load_, queue, kv, state, ttft, tok = axes
    bins = np.linspace(0, duration, max(2, int(duration / max(1.0, duration / 36))) + 1)
    counts, edges = np.histogram([r.arrival for r in reqs], bins=bins)
    load_.bar(edges[:-1], counts / np.diff(edges), width=np.diff(edges), align="edge", alpha=0.4, label="arrivals")
    grid = np.linspace(0, duration, 200)
    load_.plot(grid, tide(grid, size["rate"], duration), color="k", label="tide (mean rate)")
    load_.set_ylabel("requests/s")
    load_.legend(fontsize=8)
    colors = dict(zip(names, ("tab:blue", "tab:orange", "tab:green")))
    end = 0.0
    for name in names:
        run = runs[name]
        t = np.array([s[0] - run.t0 for s in run.samples])
        end = max(end, t.max() if len(t) else 0)
        queue.plot(t, [s[2] for s in run.samples], color=colors[name], label=name)
        kv.plot(t, [s[3] / run.extra["kv_total"] for s in run.samples], color=colors[name], label=name)
        done = sorted((o.first - run.t0, o.first - o.arrival, per_token(o)) for o in run.outcomes if completed(o))
        if done:
            times = np.array([d[0] for d in done])
            window = max(5.0, duration / 12)
            centers = np.linspace(0, times.max(), 120)
            for axis, column in ((ttft, 1), (tok, 2)):
                values = np.array([np.nan if d[column] is None else d[column] for d in done])
                rolling = [np.nanpercentile(values[(times > c - window) & (times <= c)], 95)
                           if np.any((times > c - window) & (times <= c) & ~np.isnan(values)) else np.nan
                           for c in centers]
                axis.plot(centers, rolling, color=colors[name], label=name)
    controlled = runs[names[0]]
    codes = {"normal": 0, "pressure": 1, "overload": 2}
    t = [s[0] - controlled.t0 for s in controlled.samples]
    state.step(t, [codes.get(s[4].get("state"), np.nan) for s in controlled.samples], where="post", color="tab:blue",
               label="controller state")
    state.set_yticks([0, 1, 2], ["normal", "pressure", "overload"])
    shed = state.twinx()
    shed.step(t, [max(0, s[4].get("shed", float("-inf"))) for s in controlled.samples], where="post", color="tab:red",
              alpha=0.6, label="priorities shed (below)")
    shed.set_ylabel("shed below", color="tab:red")
    queue.set_ylabel("waiting requests")
    kv.set_ylabel("KV in use / pool")
    kv.set_ylim(0, 1.05)
    ttft.axhline(slo.ttft, color="k", ls="--", lw=0.8, label="target")
    ttft.set_ylabel("TTFT p95 (s)")
    ttft.set_yscale("log")
    tok.axhline(slo.per_token, color="k", ls="--", lw=0.8, label="target")
    tok.set_ylabel("per-token p95 (s)")
    tok.set_yscale("log")
    tok.set_xlabel("seconds since the trace started (latency: rolling p95 by first-token time)")
    for axis in (queue, kv, ttft):
        axis.legend(fontsize=8)
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.axvspan(duration / 3, 2 * duration / 3, color="grey", alpha=0.08)
    load_.set_title("Tidal load: the engine with and without its controller, and transformers CB (peak shaded)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    note(f"plot: {path}")
    shown = path.name if path.parent.resolve() == common.BENCHMARKS_MD.parent.resolve() else str(path)
    return f"![load, queue, KV usage, controller state and latency over time]({shown})"


# -------------------------------------------------------------------------------------- main

def main() -> int:
    parser = arguments(__doc__.split("\n\n")[0], repeats=None)
    parser.add_argument("--minutes", type=float, help="length of the trace (default 3)")
    parser.add_argument("--rate", type=float, help="mean arrival rate, requests/s (trough rate/2, peak 1.5 x rate)")
    parser.add_argument("--burst-shape", type=float, help="shape of the gamma-distributed gaps (< 1: bursty)")
    parser.add_argument("--pool-requests", type=float, help="pool = static reservation of this many average requests")
    parser.add_argument("--batch-tokens", type=int, help="max_batch_tokens of the engine and transformers CB")
    parser.add_argument("--max-running", type=int, help="the engine's max_running")
    parser.add_argument("--drain", type=float, help="seconds after the last arrival before the rest is cancelled")
    parser.add_argument("--slo-ttft", type=float, help="time-to-first-token target, s (default: calibrated)")
    parser.add_argument("--slo-per-token", type=float, help="per-token latency target, s (default: calibrated)")
    parser.add_argument("--host-blocks", type=int,
                        help="the engines' host tier, in blocks (default: as many as the pool; 0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--plot", help="where the PNG goes (default docs/bench_load.png; a temp dir in --smoke)")
    args = parser.parse_args()
    args.repeats = args.repeats or 1
    size = dict(SMOKE if args.smoke else FULL)
    for key in ("minutes", "rate", "burst_shape", "pool_requests", "batch_tokens", "max_running", "drain"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)

    note(f"loading {model_name(args.smoke)} twice (the engine's copy and a never-enabled copy for transformers CB)")
    device = pick_device(args.device)
    plain, model, tokenizer, pad_id, stop = load_pair(args.smoke, device)
    reqs = build_trace(tokenizer, size, args.seed)
    duration = size["minutes"] * 60
    bs = size["block_size"]
    size_pool(model, reqs, size, args.host_blocks)
    # transformers CB's swap pool is pinned memory: only with an accelerator
    size["cb_offload_gib"] = ((size["host_blocks"] or 0) * size["per_block"] / 2**30 if device.type == "cuda"
                              else 0.0)
    note(f"trace: {len(reqs)} requests over {duration:.0f} s; pool {size['num_blocks']} blocks of {bs}")

    calibration = None
    if args.slo_ttft is None or args.slo_per_token is None:
        note("calibrating the SLO targets (and warming the engine up)")
        calibration = calibrate(model, reqs, stop, size)
    ttft, per_token_target = calibrated_targets(calibration) if calibration else (None, None)
    slo = SLO(ttft=args.slo_ttft or ttft, per_token=args.slo_per_token or per_token_target)
    how = ("given on the command line" if calibration is None else
           "calibrated: 5 x the median time to first token alone, 3 x the median per-token latency of 8 requests "
           "decoding together" + (", where not given on the command line" if args.slo_ttft or args.slo_per_token
                                  else ""))
    note(f"SLO: ttft {slo.ttft} s, per-token {slo.per_token} s")
    thresholds = Thresholds(dwell=size["dwell"], tick=size["tick"])
    note("timing the model alone for the bound on what any schedule could do")
    bound = machine_bound(plain, reqs, slo.ttft, size["batch_tokens"], duration)
    note(f"bound: at most {bound['most']} of {len(reqs)} first tokens in time")

    systems = {
        "engine, controller on": lambda: serve_engine(model, reqs, stop, size, "engine, controller on", True, slo,
                                                      thresholds, size["drain"], size["period"]),
        "engine, controller off": lambda: serve_engine(model, reqs, stop, size, "engine, controller off", False, slo,
                                                       thresholds, size["drain"], size["period"]),
        "transformers CB": lambda: serve_cb(plain, reqs, stop, size, pad_id, deadline_after=size["drain"],
                                            period=size["period"]),
    }
    names = list(systems)
    note("reference: per-request greedy generate (DynamicCache), every request alone, untimed")
    reference = [o.tokens for o in serve_generate(plain, poisson(reqs, float("inf"), 0), 1, stop, pad_id,
                                                  "reference").outcomes]
    warm = [Req(r.index, r.prompt, r.max_new) for r in reqs[:4]]
    note("warm-up: the engine with and without the controller, transformers CB")
    for controller in (True, False):  # also when the calibration (which serves requests on it) was skipped
        serve_engine(model, warm, stop, size, "warm-up", controller, slo, thresholds)
    serve_cb(plain, warm, stop, size, pad_id)

    runs = {name: [] for name in names}
    for round_ in range(args.repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            note(f"run {round_ + 1}/{args.repeats}: {name} ({duration:.0f} s of trace)")
            runs[name].append(systems[name]())

    def chosen(name):
        by = sorted(runs[name], key=lambda run: summarize(run, reqs, slo, duration, reference)["availability"])
        return by[len(by) // 2]

    picked = {name: chosen(name) for name in names}
    summaries = {name: summarize(picked[name], reqs, slo, duration, reference) for name in names}
    checks = Checks()
    checks.expect(all(t is not None for t in reference), "per-request generate failed a request: no reference")
    for name in names[:2]:
        for run in runs[name]:
            differ = summarize(run, reqs, slo, duration, reference)["mismatched"]
            checks.expect(not differ, f"{name}: {len(differ)} requests' tokens differ from per-request generate "
                                      f"(requests {differ[:8]})")
            checks.expect(run.extra["leaked"] == 0, f"{name}: {run.extra['leaked']} blocks still referenced after "
                                                    "every request finished")
            failed = [o.error for o in run.outcomes if o.error and not o.refused and "deadline" not in o.error]
            checks.expect(not failed, f"{name}: {len(failed)} requests failed ({failed[:2]})")
    every_run = {name: [summarize(run, reqs, slo, duration, reference)["availability"] for run in runs[name]]
                 for name in names}
    image = "" if checks.failures else plot(args, size, reqs, slo, names, picked)
    body = report(args, size, reqs, slo, how, names, summaries, calibration, every_run, bound, image)
    return checks.finish("load", body, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
