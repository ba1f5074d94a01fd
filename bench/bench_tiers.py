"""Pinning and memory tiers on SmolLM2-135M (fp32, torch backend).

    python bench/bench_tiers.py [--repeats 3]
    python bench/bench_tiers.py --smoke          # toy sizes, tiny random model, prints only

1. working set about 3x the device pool: 6 document prefixes of 256 tokens, 24 requests in
   seeded random order (prefix + a 16-token question, 4 new tokens), device pool of 40 blocks;
   reuse hit rate and tokens/s with a host tier against dropping evicted blocks (and DynamicCache,
   which reuses nothing);
2. restart: time to first token of the first request after a restart (a fresh model object and
   pool) with the disk tier holding the persisted system prompt, against a cold start (and
   DynamicCache);
3. churn: a hot 256-token system prompt asked every third request among one-off 560-token
   requests, in a 56-block pool: the hot prompt's reuse and time without pinning, with an
   explicit pin, and with automatic hot-spot pinning (and DynamicCache).

Method: every system gets one untimed warm-up run, then `--repeats` timed runs with the order of
the systems rotated every run; figures are medians, ratios compare medians of this run. Every
PagedCache run starts from a fresh pool. Prompts are cut from real text with fixed seeds; every
output is compared token for token with `DynamicCache` on a model that was never enabled (a
mismatch exits 1 and writes nothing).
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
from pathlib import Path

import torch
from common import (
    Checks,
    Timer,
    alternate,
    arguments,
    check_repeats,
    greedy,
    load_model,
    markdown_table,
    method,
    model_name,
    note,
    prompts_of_lengths,
    same,
    yes_no,
)
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache

FULL = dict(docs=6, doc_tokens=256, questions=24, question_tokens=16, ws_new=4, ws_pool=40, ws_host=256,
            system_tokens=600, restart_pool=256, hot_tokens=256, one_off_tokens=560, hot_question=12, churn_pool=56)
SMOKE = dict(docs=6, doc_tokens=32, questions=8, question_tokens=4, ws_new=2, ws_pool=6, ws_host=32,
             system_tokens=64, restart_pool=32, hot_tokens=32, one_off_tokens=72, hot_question=4, churn_pool=8)


def serve(model, prompt, new_tokens, timer: Timer):
    """One request on a fresh PagedCache (timed by `timer`, cache release included)."""
    with timer, PagedCache() as cache:
        return greedy(model, prompt, cache, new_tokens)


def working_set(model, plain, tokenizer, size, repeats, checks: Checks) -> str:
    docs = prompts_of_lengths(tokenizer, [size["doc_tokens"]] * size["docs"], seed=5)
    questions = prompts_of_lengths(tokenizer, [size["question_tokens"]] * size["questions"], seed=6)
    rng = random.Random(7)
    requests = [docs[rng.randrange(size["docs"])] + q for q in questions]
    new = size["ws_new"]

    def paged(host):
        hf_paged_kv.disable(model)
        pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=size["ws_pool"], host_blocks=host, hot_threshold=None))
        timer = Timer()
        outs = [serve(model, r, new, timer) for r in requests]
        return timer.seconds, dict(tokens=outs, stats=pool.stats())

    def dynamic():
        timer, outs = Timer(), []
        for r in requests:
            with timer:
                outs.append(greedy(plain, r, DynamicCache(), new))
        return timer.seconds, dict(tokens=outs, stats=None)

    host_label = f"host tier ({size['ws_host']} blocks)"
    runs = alternate({"DynamicCache (no reuse)": dynamic, "drop evicted blocks": lambda: paged(None),
                      host_label: lambda: paged(size["ws_host"])}, repeats, progress="working set: ")
    reference = runs["DynamicCache (no reuse)"]["outputs"][0]["tokens"]
    generated = len(requests) * new
    base = runs["drop evicted blocks"]["median"]
    rows = []
    for label, run in runs.items():
        stats = run["outputs"][-1]["stats"]
        ok = all(same(o["tokens"], reference) for o in run["outputs"])
        checks.expect(ok, f"working set, {label}: tokens differ from DynamicCache")
        rows.append([label, f"{stats['hit_rate']:.0%}" if stats else "-", f"{generated / run['median']:.2f}",
                     f"{base / run['median']:.2f}x", stats.get("promotions", 0) if stats else "-",
                     stats.get("demotions", 0) if stats else "-", yes_no(ok)])
    total_blocks = size["docs"] * size["doc_tokens"] // 16
    what = ("; every PagedCache run starts on a fresh pool; hit rates and tier counts are those of one run (the same "
            "in every run)")
    return (f"**1. Working set 3x the device pool** ({size['docs']} x {size['doc_tokens']}-token prefixes = "
            f"{total_blocks} blocks, device pool {size['ws_pool']} blocks, {len(requests)} requests of "
            f"{new} new tokens):\n\n"
            + markdown_table(["device pool", "hit rate", "tokens/s", "speed vs dropping", "promotions", "demotions",
                              "same tokens as DynamicCache"], rows)
            + f"\n\n{method(repeats, what)}")


def forget_pages(directory) -> None:
    """Ask the kernel to drop the block files' pages from its page cache (Linux), so that they are
    read from the disk; written back first, as dirty pages are not dropped."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in Path(directory).glob("*.kvblock"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restart(tokenizer, smoke, size, repeats, checks: Checks) -> str:
    system, question = prompts_of_lengths(tokenizer, [size["system_tokens"], 20 if not smoke else 4], seed=8)
    prompt = system + question
    with tempfile.TemporaryDirectory() as directory:
        first, _ = load_model(smoke)
        hf_paged_kv.enable(first, pool=KVPool(num_blocks=size["restart_pool"], disk_dir=directory))
        persisted = hf_paged_kv.persist(first, system)
        hf_paged_kv.disable(first)
        del first

        def after_restart(disk):
            fresh, _ = load_model(smoke)  # the restarted process: a new model object and a new pool
            pool = hf_paged_kv.enable(fresh, pool=KVPool(num_blocks=size["restart_pool"], disk_dir=disk))
            if disk is not None:  # after the pool read the files' headers: the request reads them from the disk
                forget_pages(disk)
            timer = Timer()
            out = serve(fresh, prompt, 1, timer)
            stats = pool.stats()
            hf_paged_kv.disable(fresh)
            return timer.seconds, dict(tokens=out, disk_hits=stats.get("disk_hits", 0), hits=stats["hit_tokens_prefix"])

        def dynamic():
            fresh, _ = load_model(smoke)
            with Timer() as timer:
                out = greedy(fresh, prompt, DynamicCache(), 1)
            return timer.seconds, dict(tokens=out, disk_hits="-", hits="-")

        runs = alternate({"DynamicCache": dynamic, "cold start": lambda: after_restart(None),
                          "disk tier": lambda: after_restart(directory)}, repeats, progress="restart: ")
    reference = runs["DynamicCache"]["outputs"][0]["tokens"]
    base = runs["cold start"]["median"]
    rows = []
    for label, run in runs.items():
        ok = all(torch.equal(o["tokens"], reference) for o in run["outputs"])
        checks.expect(ok, f"restart, {label}: first token differs from DynamicCache")
        last = run["outputs"][-1]
        rows.append([label, f"{run['median']:.3f}", last["disk_hits"], last["hits"], f"{base / run['median']:.1f}x",
                     yes_no(ok)])
    served = [o["hits"] for o in runs["disk tier"]["outputs"]]
    checks.expect(all(hits == persisted for hits in served),
                  f"restart: the disk tier served {served} tokens in its runs, {persisted} were persisted")
    what = ("; each run loads a fresh model object and a fresh pool (untimed) and times its first request "
            "(one new token); the block files were written once before (`hf_paged_kv.persist`, "
            f"{persisted} tokens) and are read by every disk-tier run, their pages dropped from the OS page cache "
            "before it (`posix_fadvise(DONTNEED)`; where that is not available the reads are warm)")
    return (f"**2. Restart**: first request after a restart, a {len(prompt)}-token prompt whose "
            f"{size['system_tokens']}-token system prompt was persisted before:\n\n"
            + markdown_table(["after restart", "time to first token s", "blocks read from disk",
                              "prompt tokens inherited", "speed vs cold start", "same tokens as DynamicCache"], rows)
            + f"\n\n{method(repeats, what)}")


def churn(model, plain, tokenizer, size, repeats, checks: Checks) -> str:
    hot = prompts_of_lengths(tokenizer, [size["hot_tokens"]], seed=9)[0]
    one_offs = prompts_of_lengths(tokenizer, [size["one_off_tokens"]] * 10, seed=10)
    questions = prompts_of_lengths(tokenizer, [size["hot_question"]] * 5, seed=11)
    schedule = []
    for i in range(15):
        schedule.append(("hot", hot + questions[i // 3]) if i % 3 == 2 else ("one-off", one_offs[i - i // 3 - 1]))
    reused_tokens = len(hot) // 16 * 16

    def paged(policy):
        hf_paged_kv.disable(model)
        pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=size["churn_pool"], pin_budget=0.3,
                                                     hot_threshold=1.5 if policy == "auto" else None))
        if policy == "explicit":
            hf_paged_kv.pin(model, hot)
        hot_times, hits, outs = [], 0, []
        for kind, prompt in schedule:
            before, timer = pool.stats()["hit_tokens_prefix"], Timer()
            outs.append(serve(model, prompt, 2 if kind == "hot" else 1, timer))
            if kind == "hot":
                hot_times.append(timer.seconds)
                hits += pool.stats()["hit_tokens_prefix"] - before >= reused_tokens
        pins = [p["reason"] for p in pool.stats()["pins"]]
        return statistics.median(hot_times), dict(tokens=outs, hits=hits, pins=", ".join(pins) or "-")

    def dynamic():
        hot_times, outs = [], []
        for kind, prompt in schedule:
            with Timer() as timer:
                outs.append(greedy(plain, prompt, DynamicCache(), 2 if kind == "hot" else 1))
            if kind == "hot":
                hot_times.append(timer.seconds)
        return statistics.median(hot_times), dict(tokens=outs, hits="-", pins="-")

    runs = alternate({"DynamicCache (no reuse)": dynamic, "no pinning": lambda: paged(None),
                      "explicit pin": lambda: paged("explicit"), "automatic hot-spot pin": lambda: paged("auto")},
                     repeats, progress="churn: ")
    reference = runs["DynamicCache (no reuse)"]["outputs"][0]["tokens"]
    hot_count = sum(kind == "hot" for kind, _ in schedule)
    rows = []
    for label, run in runs.items():
        ok = all(same(o["tokens"], reference) for o in run["outputs"])
        checks.expect(ok, f"churn, {label}: tokens differ from DynamicCache")
        last = run["outputs"][-1]
        reused = f"{last['hits']}/{hot_count}" if last["hits"] != "-" else "-"
        rows.append([label, reused, f"{run['median']:.3f}", last["pins"], yes_no(ok)])
    what = ("; a run is the whole schedule of 15 requests on a fresh pool, its figure the median time of its "
            f"{hot_count} hot requests (2 new tokens each); \"reused\" counts hot requests that inherited all "
            f"{reused_tokens} tokens of the hot prompt's whole blocks (one run; the same in every run)")
    return (f"**3. Churn**: a hot {size['hot_tokens']}-token system prompt every third request among one-off "
            f"{size['one_off_tokens']}-token requests, {size['churn_pool']}-block pool (pin budget 30%):\n\n"
            + markdown_table(["policy", "hot prompt reused", "hot request time s (median)", "pins at the end",
                              "same tokens as DynamicCache"], rows)
            + f"\n\n{method(repeats, what)}")


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0]).parse_args(argv)
    check_repeats(args)
    size = SMOKE if args.smoke else FULL
    model, tokenizer = load_model(args.smoke)
    plain, _ = load_model(args.smoke)  # never enabled: the DynamicCache baseline
    checks = Checks()
    sections = []
    note("working set")
    sections.append(working_set(model, plain, tokenizer, size, args.repeats, checks))
    note("restart")
    sections.append(restart(tokenizer, args.smoke, size, args.repeats, checks))
    note("churn")
    sections.append(churn(model, plain, tokenizer, size, args.repeats, checks))
    hf_paged_kv.disable(model)
    body = f"### Pinning and tiers ({model_name(args.smoke)}, fp32, torch backend)\n\n" + "\n\n".join(sections)
    return checks.finish("bench_tiers", body, args.smoke)


if __name__ == "__main__":
    raise SystemExit(main())
