"""Paging on SmolLM2-135M (fp32, torch backend) for a LEFT-PADDED batch: KV memory and speed,
PagedCache vs DynamicCache.

    python bench/bench_paging.py [--new-tokens 64] [--repeats 3]
    python bench/bench_paging.py --smoke         # toy sizes, tiny random model, prints only

The workload is one batch of 8 prompts of 32..512 tokens of real text, left-padded to 512:
DynamicCache stores (and attends over) the padding, PagedCache never stores it. These figures
therefore describe padded batches; decode on uniform rows (no padding, long contexts) is
measured by bench_decode.py. Reuse is off (`PagedCache(reuse=False)`): this is paging alone.

(a) KV memory held at the end of generation: DynamicCache's tensors against the blocks the
    PagedCache holds, the pool's high-water mark, and the pool's whole reservation
    (`stats()["bytes_total"]`, allocated when the model is enabled); tokens/s of `generate`;
(b) decode time per step (one new token per row) at batch 1 (the 512-token prompt alone: no
    padding) and batch 8 (the padded batch): after an untimed prefill, the median of N
    single-token forwards as generate's decode loop makes them.

Method: one untimed warm-up run of each system, then `--repeats` runs alternating the order of
the two; figures are medians, ratios compare medians of this run. The baseline is a model that
was never enabled. Tokens are compared with DynamicCache's (a mismatch exits 1, nothing written).
"""

from __future__ import annotations

import statistics
import time

import torch
from common import (
    Checks,
    Timer,
    alternate,
    arguments,
    check_repeats,
    dynamic_cache_bytes,
    greedy,
    left_pad,
    load_model,
    markdown_table,
    method,
    mib,
    model_name,
    note,
    paged_cache_bytes,
    prompts_of_lengths,
    yes_no,
)
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache

LENGTHS = [32, 100, 170, 240, 310, 380, 450, 512]
SMOKE_LENGTHS = [4, 12, 21, 30, 38, 47, 56, 64]


def decode_steps(model, cache, ids, mask, steps):
    """Prefill (untimed), then `steps` single-token forwards feeding back the argmax: (per-step
    seconds, the tokens chosen)."""
    with torch.inference_mode():
        positions = (mask.cumsum(1) - 1).clamp_min(0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, logits_to_keep=1)
        times, tokens = [], []
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            positions = positions[:, -1:] + 1
            start = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        logits_to_keep=1)
            times.append(time.perf_counter() - start)
    return times, torch.cat(tokens, dim=1)


def main(argv=None) -> int:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, help="new tokens per row (default 64; smoke 4)")
    parser.add_argument("--pool-mib", type=int, default=512, help="the pool's size (default 512 MiB)")
    args = parser.parse_args(argv)
    check_repeats(args)
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    n = args.new_tokens or (4 if args.smoke else 64)
    pool_bytes = (8 if args.smoke else args.pool_mib) << 20
    model, tokenizer = load_model(args.smoke)
    plain, _ = load_model(args.smoke)  # never enabled: the DynamicCache baseline
    pool = hf_paged_kv.enable(model, pool=KVPool(max_bytes=pool_bytes))
    ids, mask = left_pad(prompts_of_lengths(tokenizer, lengths, seed=0), tokenizer.pad_token_id)
    checks = Checks()
    state = {}

    # (a) memory and throughput of the padded batch
    def dynamic():
        cache = DynamicCache()
        with Timer() as timer:
            out = greedy(plain, ids, cache, n, mask)
        state["dynamic_bytes"] = dynamic_cache_bytes(cache)
        return timer.seconds, out

    def paged():
        with PagedCache(reuse=False) as cache:
            with Timer() as timer:
                out = greedy(model, ids, cache, n, mask)
            state["stats"] = pool.stats()  # while the cache still holds its blocks
            state["paged_bytes"] = state["stats"]["bytes_used"]
            state["cache_bytes"] = paged_cache_bytes(cache)
        return timer.seconds, out

    note("(a) padded batch: memory and tokens/s")
    runs = alternate({"dynamic": dynamic, "paged": paged}, args.repeats, progress="(a) generate: ")
    reference = runs["dynamic"]["outputs"][0]
    identical = all(torch.equal(o, reference) for o in runs["paged"]["outputs"])
    checks.expect(identical, "(a) PagedCache's tokens differ from DynamicCache's")
    checks.expect(state["paged_bytes"] == state["cache_bytes"],
                  f"(a) the pool counts {state['paged_bytes']:,} bytes in use, the cache holds "
                  f"{state['cache_bytes']:,}")
    stats, dyn_bytes, pag_bytes = state["stats"], state["dynamic_bytes"], state["paged_bytes"]
    high_water = stats["blocks_used_high_water"] * stats["bytes_per_block"]
    tps = {k: len(lengths) * n / run["median"] for k, run in runs.items()}
    table_a = markdown_table(
        ["KV memory at the end of generation", "bytes", "ratio to DynamicCache"],
        [["DynamicCache (padded tensors)", f"{dyn_bytes:,}", "1.00x"],
         ["PagedCache: blocks in use (`bytes_used`)", f"{pag_bytes:,}",
          f"{pag_bytes / dyn_bytes:.2f}x (target <= 0.65x)"],
         ["PagedCache: pool high-water mark", f"{high_water:,}", f"{high_water / dyn_bytes:.2f}x"],
         ["PagedCache: the pool's reservation (`bytes_total`)", f"{stats['bytes_total']:,}",
          f"{stats['bytes_total'] / dyn_bytes:.2f}x (KVPool(max_bytes={mib(pool_bytes)}), reserved when enabled)"]],
    )
    table_speed = markdown_table(
        ["cache", f"tokens/s ({len(lengths)} x {n} new)", "ratio", "identical tokens"],
        [["DynamicCache", f"{tps['dynamic']:.1f}", "1.00x", ""],
         ["PagedCache", f"{tps['paged']:.1f}", f"{tps['paged'] / tps['dynamic']:.2f}x", yes_no(identical)]],
    )

    # (b) decode time per step
    rows = []
    for batch in (1, len(lengths)):
        b_ids, b_mask = (ids[-1:], mask[-1:]) if batch == 1 else (ids, mask)

        def dynamic_decode(b_ids=b_ids, b_mask=b_mask):
            times, tokens = decode_steps(plain, DynamicCache(), b_ids, b_mask, n)
            return statistics.median(times), tokens

        def paged_decode(b_ids=b_ids, b_mask=b_mask):
            with PagedCache(reuse=False) as cache:
                times, tokens = decode_steps(model, cache, b_ids, b_mask, n)
            return statistics.median(times), tokens

        note(f"(b) decode, batch {batch}")
        runs = alternate({"dynamic": dynamic_decode, "paged": paged_decode}, args.repeats,
                         progress=f"(b) decode, batch {batch}: ")
        ok = all(torch.equal(o, runs["dynamic"]["outputs"][0]) for o in runs["paged"]["outputs"])
        checks.expect(ok, f"(b) decode, batch {batch}: PagedCache's tokens differ from DynamicCache's")
        dyn, pag = runs["dynamic"]["median"] * 1e3, runs["paged"]["median"] * 1e3
        workload = "one 512-token prompt, no padding" if batch == 1 else "the padded batch (paged skips the padding)"
        if args.smoke:
            workload = workload.replace("512", str(lengths[-1]))
        rows.append([batch, workload, f"{dyn:.1f}", f"{pag:.1f}", f"{pag / dyn:.3f}x (target <= 1.10x)", yes_no(ok)])
    table_b = markdown_table(["batch", "rows", "DynamicCache ms/step", "PagedCache ms/step", "ratio", "same tokens"],
                             rows)

    body = (
        f"### Paging on a left-padded batch: KV memory and speed ({model_name(args.smoke)}, fp32, torch backend, "
        "reuse off)\n\n"
        f"Workload: {len(lengths)} prompts of {lengths[0]}..{lengths[-1]} tokens of real text, left-padded to "
        f"{lengths[-1]}, {n} new tokens each, block size {pool.block_size}. DynamicCache stores and attends over "
        "the padding, PagedCache skips it: these ratios hold for padded batches. Decode on uniform rows (nothing to "
        "skip) at contexts up to 8k is in the decode section (bench_decode.py).\n\n"
        f"(a) KV memory (the same in every run) and generate throughput:\n\n{table_a}\n\n{table_speed}\n\n"
        f"(b) decode time per step (one new token per row; a run's figure is the median of its {n} steps after an "
        f"untimed prefill):\n\n{table_b}\n\n"
        + method(args.repeats, "; the DynamicCache baseline runs on a model that was never enabled")
    )
    return checks.finish("bench_paging", body, args.smoke)


if __name__ == "__main__":
    raise SystemExit(main())
