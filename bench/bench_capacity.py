"""How many sequences run at once in the same KV memory (SmolLM2-135M, fp32; CPU, or CUDA when
there is one): the engine against a static reservation and transformers' continuous batching.

    python bench/bench_capacity.py                 # 3 rounds, about 45 minutes on 2 CPU cores
    python bench/bench_capacity.py --smoke         # tiny random Llama, a few seconds, prints only

Workload: bench_engine's 64 requests of real text (a third sharing a system prompt), all
arriving at once, each stopping at the end of its first sentence, in two settings of the cap a
client sends: bench_engine's `max_new_tokens` of 16..64, and 256..1024 (a chat client's usual
cap; the outputs are the same text, longer where a sentence runs on). Every system gets the same
pool: bench_engine's 245 blocks of 16 tokens.

- static reservation: what a server reserving prompt + max_new_tokens per request holds at once,
  as the most requests whose reservations fit (smallest first), and as the pool over the mean
  reservation (bench_engine's figure);
- ceiling: the most requests whose prompts and first tokens fit (smallest first, the shared
  system prompt stored once), a bound for any system;
- the engine (`controller=False`), with its growth reserve as it is (SGLang's decaying share,
  capped by what finished requests used) and with SGLang's rule alone
  (`Limits(growth_from_outputs=False)`), a fresh engine and pool per run: it learns during the run;
- transformers' `ContinuousBatchingManager` with the same blocks (`ContinuousBatchingConfig`).

Reported per cap and system: the most sequences running at once (the engine's exact high-water
mark; transformers' sampled every 50 ms) and the ratio to the static reservation, the mean
running, throughput, preemptions, peak KV and whether every request's tokens equal per-request
greedy `generate` (run once with the larger cap and cut at each request's cap: greedy tokens do
not depend on the cap). The engine must match and fail nothing, or the script exits 1.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np
import torch
from bench_engine import (
    FULL,
    SMOKE,
    Req,
    blocks_for,
    bytes_per_block,
    concurrency_ceiling,
    cut,
    load_pair,
    most_that_fit,
    pick_device,
    poisson,
    serve_cb,
    serve_engine,
    serve_generate,
    summarize,
    workload,
)
from common import Checks, arguments, check_repeats, markdown_table, mib, model_name, note

CAPS = {"full": [FULL["new"], (256, 1024)], "smoke": [SMOKE["new"], (24, 64)]}
POOL_BLOCKS = {"full": 245, "smoke": 60}  # bench_engine's pools (30 % / 35 % of its static reservation)
SYSTEMS = ["engine", "engine, SGLang's rule alone", "transformers CB"]


def static_fit(reqs, num_blocks: int, block_size: int) -> int:
    """The most requests whose prompt + max_new_tokens reservations fit at once, smallest first."""
    return most_that_fit([blocks_for(len(r.prompt) + r.max_new, block_size) for r in reqs], num_blocks)


def with_caps(base, caps: tuple[int, int], size: dict, seed: int = 0):
    """The same requests with max_new_tokens drawn uniformly from `caps` (seeded); bench_engine's
    own draw for its caps."""
    if caps == size["new"]:
        return base
    news = np.random.default_rng(seed).integers(caps[0], caps[1] + 1, len(base))
    return [Req(r.index, r.prompt, int(n), r.arrival, r.priority, r.shared, r.group) for r, n in zip(base, news)]


def main() -> int:
    parser = arguments(__doc__.split("\n\n")[0], repeats=None)
    parser.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.smoke else 3)
    check_repeats(args)
    scale = "smoke" if args.smoke else "full"
    size = dict(SMOKE if args.smoke else FULL, num_blocks=POOL_BLOCKS[scale])
    bs = size["block_size"]
    note(f"loading {model_name(args.smoke)} twice (the engine's copy and a never-enabled copy)")
    plain, model, tokenizer, pad_id, stop = load_pair(args.smoke, pick_device(args.device))
    base = poisson(workload(tokenizer, size), float("inf"), 0)
    settings = {caps: with_caps(base, caps, size) for caps in CAPS[scale]}

    note("reference: per-request greedy generate with the larger cap")
    longest = settings[CAPS[scale][-1]]
    reference_long = [o.tokens for o in serve_generate(plain, longest, 1, stop, pad_id, "reference").outcomes]
    systems = {
        "engine": lambda reqs: serve_engine(model, reqs, stop, size),
        "engine, SGLang's rule alone": lambda reqs: serve_engine(model, reqs, stop,
                                                                 size | {"limits": {"growth_from_outputs": False}}),
        "transformers CB": lambda reqs: serve_cb(plain, reqs, stop, size, pad_id),
    }
    warm = base[: size["warmup"]]
    for name in SYSTEMS:
        note(f"warm-up: {name}")
        systems[name](warm)
    results = {caps: {name: [] for name in SYSTEMS} for caps in settings}
    for round_ in range(args.repeats):
        for k, (caps, reqs) in enumerate(settings.items()):
            shift = (round_ + k) % len(SYSTEMS)
            order = SYSTEMS[shift:] + SYSTEMS[:shift]
            for name in order[::-1] if round_ % 2 else order:
                note(f"round {round_ + 1}/{args.repeats}, caps {caps[0]}..{caps[1]}: {name}")
                results[caps][name].append(systems[name](reqs))

    checks = Checks()
    checks.expect(all(t is not None for t in reference_long), "the reference generate failed a request")
    per_block = bytes_per_block(model, size["num_blocks"], bs)
    rows, notes = [], []
    for caps, reqs in settings.items():
        reference = [cut(tokens, stop, r.max_new) for tokens, r in zip(reference_long, reqs)]
        static = static_fit(reqs, size["num_blocks"], bs)
        mean_static = size["num_blocks"] / statistics.mean(blocks_for(len(r.prompt) + r.max_new, bs) for r in reqs)
        ceiling = concurrency_ceiling(reqs, size["num_blocks"], bs)
        rows.append([f"{caps[0]}..{caps[1]}", "static reservation", f"{static} (pool / mean reservation: "
                     f"{mean_static:.1f})", "1.0x", "-", "-", "-", "-", "-"])
        rows.append(["", "ceiling (any system)", str(ceiling), f"{ceiling / static:.1f}x", "-", "-", "-", "-", "-"])
        for name in SYSTEMS:
            summaries = [summarize(run, reference) for run in results[caps][name]]
            for run, s in zip(results[caps][name], summaries):
                if name.startswith("engine"):
                    checks.expect(not s["mismatched"] and s["failed"] == 0,
                                  f"{name}, caps {caps}: {len(s['mismatched'])} requests differ from per-request "
                                  f"generate, {s['failed']} failed")
                    checks.expect(run.extra["leaked"] == 0, f"{name}, caps {caps}: blocks leaked")

            def median(key):
                return statistics.median(s[key] for s in summaries)

            most = median("max_running")
            rows.append(["", name, f"{most:.0f} ({' / '.join(str(s['max_running']) for s in summaries)})",
                         f"{most / static:.1f}x", f"{median('mean_running'):.1f}", f"{median('throughput'):.1f}",
                         f"{median('preemptions'):.0f}", f"{mib(median('peak_kv'))}",
                         "yes" if all(not s["mismatched"] and not s["failed"] for s in summaries)
                         else f"NO ({max(len(s['mismatched']) + s['failed'] for s in summaries)} requests)"])
        outputs = sum(map(len, reference))
        notes.append(f"{caps[0]}..{caps[1]}: {outputs} tokens generated in all (mean {outputs / len(reqs):.0f} per "
                     f"request, {sum(len(t) >= r.max_new for t, r in zip(reference, reqs))} requests stopped by "
                     f"their cap)")

    n = len(base)
    body = "\n".join([
        f"### Capacity: sequences at once in the same memory ({model_name(args.smoke)}, fp32, "
        f"{'CPU' if pick_device(args.device).type == 'cpu' else 'CUDA'})",
        "",
        f"bench_engine's {n} requests arriving at once, each stopping at the end of its first sentence, in two "
        f"settings of the `max_new_tokens` a client sends ({'; '.join(notes)}). Every system: "
        f"{size['num_blocks']} blocks of {bs} tokens ({mib(size['num_blocks'] * per_block)}); the engine "
        f"`Engine(max_running={size['max_running']}, max_batch_tokens={size['batch_tokens']}, controller=False)`, a "
        f"fresh engine and pool per run (its estimate of outputs starts empty); transformers CB with the same "
        f"`num_blocks`, `block_size`, `max_batch_tokens` and `max_requests_per_batch`.",
        "",
        markdown_table(["caps", "system", "most running at once (every run)", "vs static reservation",
                        "mean running", "tokens/s", "preemptions", "peak KV", "same tokens as per-request generate"],
                       rows),
        "",
        "Static reservation: the most requests whose prompt + max_new_tokens fit in the pool at once, smallest first "
        "(the pool over the mean reservation, bench_engine's figure, in brackets); ratios are against the first. "
        "Ceiling: the most requests whose prompts and first tokens fit at once, smallest first, the shared system "
        "prompt's full blocks stored once. The engine's most running is its exact high-water mark, transformers "
        "CB's is sampled every 50 ms; mean running is over the makespan (sampled every 50 ms).",
        "",
        f"Method: {args.repeats} round{'s' if args.repeats > 1 else ''} after one untimed warm-up run of each system "
        f"on {size['warmup']} requests; in each round every setting runs every system, the order rotated per round "
        "and setting and reversed every other round; figures are medians over the rounds. Client and servers in one "
        f"process ({torch.get_num_threads()} torch threads).",
    ])
    return checks.finish("capacity", body, args.smoke, after="engine")


if __name__ == "__main__":
    sys.exit(main())
