"""bench_load's trace on a stand-in model paced to SmolLM2's forward times: variants of the engine's
scheduling rules compared with less noise than real runs, several runs at once.

    python bench/emulate_load.py                      # controller on and off, 3 runs each, 2 at a time
    python bench/emulate_load.py --variants on off no-burst no-partial-rule
    python bench/emulate_load.py --slo-ttft 0.6 0.8 1.0 1.3 --repeats 3 --parallel 4   # availability by target
    python bench/emulate_load.py --smoke              # tiny sizes, a few seconds, prints only

Real runs of bench_load move by about 4 of its 99 requests from one to the next (the machine's speed
drifts, and client, engine and OpenMP share two cores): more than most scheduling changes. Here the
engine, its scheduler and its controller run as they are, on bench_load's trace (the same requests,
arrivals, pool, host tier, limits and SLO targets, calibrated the same way unless given), but the
model is a tiny random Llama whose forwards sleep until they have taken as long as SmolLM2's: the
line `fixed + per_token x n` under the model alone's forward times on this machine
(`feasibility.forward_line`, measured in the same run, as bench_load's bound does). Each request
generates exactly as many tokens as SmolLM2 gives it with per-request greedy `generate` (the
stand-in's tokens mean nothing, so no stop token). Forwards mostly sleep, so `--parallel` runs go
side by side. What it leaves out: every cost of the real model above that line (attention over
long contexts, the machine's drift, a cold start), so its figures compare variants on one model of
the machine; they are not bench_load's figures.

Variants (each run in a process of its own, module constants set there before the engine starts):
`on` / `off`: the engine with / without the controller; `rules-only`: without the controller but with
the limits it sets from its SLO (`ttft_target`, `per_token_target`, `burst_batch_tokens`: every
target-driven rule, none of the controller's moves); with the controller and one rule switched
off: `no-burst` (no forward past `max_batch_tokens`: `Limits.burst_batch_tokens` equal to it),
`no-partial-rule` (`scheduler.PARTIAL_DELAY` infinite: partial chunks never wait). Triage and
yielding, which earlier runs of this script measured, showed no gain and were deleted.

With several `--slo-ttft` targets, every variant runs at each of them (the engine and its controller
configured with that target) and the table goes to a section of its own: how availability within
targets moves with the time-to-first-token target, for example where each variant first reaches
99.5%.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import bench_load
import numpy as np
import torch
from bench_engine import (Req, completed, load, model_alone, pad_token, per_token, poisson, serve_engine, serve_generate,
                          stop_ids)
from common import Checks, arguments, markdown_table, model_name, note
from feasibility import forward_line
from transformers import LlamaConfig, LlamaForCausalLM

from hf_paged_kv.engine import SLO, Thresholds, scheduler
from hf_paged_kv.engine import controller as controller_rules

VARIANTS = ("on", "off", "rules-only", "no-burst", "no-partial-rule")


def stand_in(vocab: int, fixed: float, per_token_: float) -> LlamaForCausalLM:
    """A tiny random Llama whose every forward over n tokens takes at least `fixed + per_token_ x n`."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=4096)).eval()
    started = [0.0]

    def begin(_, args, kwargs):
        started[0] = time.monotonic()

    def pace(_, args, kwargs, output):
        time.sleep(max(0.0, started[0] + fixed + per_token_ * kwargs["input_ids"].shape[1] - time.monotonic()))

    model.register_forward_pre_hook(begin, with_kwargs=True)
    model.register_forward_hook(pace, with_kwargs=True)
    return model


def run_variant(variant: str, reqs: list[Req], size: dict, slo: SLO, vocab: int, line: tuple[float, float]) -> dict:
    """One run of the trace on the stand-in, in this process (a worker's); what the report needs."""
    torch.set_num_threads(1)  # runs side by side: each forward is mostly sleep
    controller = variant not in ("off", "rules-only")
    if variant == "no-partial-rule":
        scheduler.PARTIAL_DELAY = math.inf
    size = dict(size, burst_batch_tokens=size["batch_tokens"] if variant == "no-burst" else None)
    if variant == "rules-only":  # the limits the controller sets from its SLO, and none of its moves
        size.update(ttft_target=slo.ttft, per_token_target=slo.per_token,
                    burst_batch_tokens=controller_rules.BUDGET_CEILING * size["batch_tokens"])
    model = stand_in(vocab, *line)
    thresholds = Thresholds(dwell=size["dwell"], tick=size["tick"])
    serve_engine(model, [Req(r.index, r.prompt, r.max_new) for r in reqs[:4]], [], size, "warm-up", controller, slo,
                 thresholds)
    run = serve_engine(model, reqs, [], size, variant, controller, slo, thresholds, size["drain"], size["period"])
    duration = size["minutes"] * 60
    outs = run.outcomes
    peak = [o.first - o.arrival for r, o in zip(reqs, outs) if completed(o) and bench_load.at_peak(r, duration)]
    return dict(within=sum(bench_load.in_slo(o, slo) for o in outs), submitted=len(outs),
                late_first=sum(1 for o in outs if completed(o) and o.first - o.arrival > slo.ttft),
                slow=sum(1 for o in outs if completed(o) and (per_token(o) or 0.0) > slo.per_token),
                lost=sum(1 for o in outs if not completed(o)), preemptions=run.preemptions,
                p99_peak=float(np.percentile(peak, 99)) if peak else float("nan"),
                generated_as_asked=all(o.tokens is not None and len(o.tokens) == r.max_new
                                       for r, o in zip(reqs, outs) if completed(o)),
                leaked=run.extra["leaked"])


def main() -> int:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["on", "off"])
    parser.add_argument("--parallel", type=int, default=2, help="runs side by side (each its own process)")
    parser.add_argument("--slo-ttft", type=float, nargs="+",
                        help="time-to-first-token target(s), s (default: calibrated); several: each variant at each")
    parser.add_argument("--slo-per-token", type=float, help="per-token latency target, s (default: calibrated)")
    args = parser.parse_args()
    size = dict(bench_load.SMOKE if args.smoke else bench_load.FULL)

    note(f"loading {model_name(args.smoke)}")
    model, tokenizer = load(args.smoke)
    stop = stop_ids(model, tokenizer)
    pad_id = pad_token(model, tokenizer)
    reqs = bench_load.build_trace(tokenizer, size, 0)
    bench_load.size_pool(model, reqs, size)
    calibration = None
    if args.slo_ttft is None or args.slo_per_token is None:
        calibration = bench_load.calibrate(model, reqs, stop, size)
    ttft, per_token_target = bench_load.calibrated_targets(calibration) if calibration else (None, None)
    per_token_target = args.slo_per_token or per_token_target
    slos = [SLO(ttft=target, per_token=per_token_target) for target in args.slo_ttft or [ttft]]
    sweep = len(slos) > 1
    sizes = sorted({1, size["batch_tokens"] // 8, size["batch_tokens"] // 2, size["batch_tokens"]})
    line = forward_line(lambda n: model_alone(model, reqs, 0, [(n, 1)]), sizes)
    note(f"SLO: ttft {', '.join(f'{slo.ttft:g}' for slo in slos)} s, per-token {per_token_target} s; forwards paced "
         f"to {line[0] * 1e3:.0f} ms + {line[1] * 1e3:.2f} ms x n")
    note(f"the number of tokens {model_name(args.smoke)} gives each request (per-request greedy generate, untimed)")
    lengths = [len(o.tokens) for o in serve_generate(model, poisson(reqs, float("inf"), 0), 1, stop, pad_id,
                                                     "lengths").outcomes]
    trace = [Req(r.index, r.prompt, n, r.arrival, r.priority, r.shared, r.group) for r, n in zip(reqs, lengths)]
    jobs = [(slo, v) for _ in range(args.repeats) for slo in slos for v in args.variants]
    note(f"{len(jobs)} runs of {size['minutes'] * 60:.0f} s of trace, {args.parallel} at a time")
    context = multiprocessing.get_context("spawn")
    # a fresh process per run: a variant's module constants must not carry into the next run
    with ProcessPoolExecutor(args.parallel, mp_context=context, max_tasks_per_child=1) as pool:
        futures = [pool.submit(run_variant, v, trace, size, slo, model.config.vocab_size, line) for slo, v in jobs]
        results = [f.result() for f in futures]
    runs = {(slo, v): [r for job, r in zip(jobs, results) if job == (slo, v)] for slo in slos for v in args.variants}
    checks = Checks()
    for (slo, v), rs in runs.items():
        checks.expect(all(r["lost"] == 0 and r["leaked"] == 0 for r in rs),
                      f"{v} at {slo.ttft:g} s: a request lost or a block leaked")
        checks.expect(all(r["generated_as_asked"] for r in rs),
                      f"{v} at {slo.ttft:g} s: a request generated another number of tokens")
    header = ["TTFT target s", "variant", "within targets, every run", "median", "first tokens late", "per-token late",
              "p99 TTFT at the peak s", "preemptions"]
    rows = []
    for (slo, v), rs in runs.items():
        def med(key):
            return statistics.median(r[key] for r in rs)
        rows.append([f"{slo.ttft:g}", v, " / ".join(str(r["within"]) for r in rs) + f" of {rs[0]['submitted']}",
                     med("within"), med("late_first"), med("slow"), f"{med('p99_peak'):.2f}", med("preemptions")])
    targets = ", ".join(f"{slo.ttft:g}" for slo in slos)
    what = "availability by time-to-first-token target" if sweep else "scheduling variants"
    body = "\n".join([
        f"### Emulated tidal load: {what} ({model_name(args.smoke)}'s forward times, stand-in model)", "",
        f"bench_load's trace (seed 0, {len(reqs)} requests over {size['minutes'] * 60:.0f} s, pool {size['num_blocks']} "
        f"blocks of {size['block_size']}, host tier as many, `max_batch_tokens={size['batch_tokens']}`); SLO targets "
        f"{targets} s / {per_token_target:g} s; forwards paced to {line[0] * 1e3:.0f} ms + {line[1] * 1e3:.2f} ms x n "
        "(the line under the model alone's forward times here), each request generating as many tokens as "
        f"{model_name(args.smoke)} gives it. Not bench_load's figures: a model of this machine for comparing "
        "variants.", "", markdown_table(header, rows), "",
        f"Method: median of {args.repeats} runs of each variant, the variants interleaved in the order given, "
        f"{args.parallel} runs side by side, each in a process of its own and after an untimed warm-up of 4 requests"
        f"{'; the engine and its controller configured with the target of the row' if sweep else ''}; "
        "time to first token counts from the request's submission; at the peak: requests arriving in the middle "
        "third of the trace.",
    ])
    if sweep:
        return checks.finish("emulated-load-targets", body, args.smoke, after="emulated-load")
    return checks.finish("emulated-load", body, args.smoke, after="load")


if __name__ == "__main__":
    sys.exit(main())
