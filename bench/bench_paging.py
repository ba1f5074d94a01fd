"""Paging on SmolLM2-135M (fp32, CPU or GPU): KV memory and speed, PagedCache vs DynamicCache.

    python bench/bench_paging.py [--new-tokens 64] [--repeats 3]

(a) one batch of 8 prompts of 32..512 tokens (real text, left-padded): KV bytes held at the end
    of generation and tokens/s; (b) decode time per token at batch 1 and batch 8, measured as
    (time of prefill + N tokens - time of prefill + 1 token) / (N - 1). Both caches run
    alternately in the same process and every ratio compares figures from this run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import (
    dynamic_cache_bytes,
    left_pad,
    markdown_table,
    paged_cache_bytes,
    prompts_of_lengths,
    record,
)
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache
from hf_paged_kv.real_model import load_smollm2

LENGTHS = [32, 100, 170, 240, 310, 380, 450, 512]


def generate(model, cache, ids, mask, new_tokens):
    with torch.inference_mode():
        return model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=cache,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        )


def run_both(model, ids, mask, new_tokens, repeats):
    """Median seconds per cache kind, runs interleaved so drift hits both alike."""
    times = {"dynamic": [], "paged": []}
    for _ in range(repeats):
        for kind in times:
            cache = DynamicCache() if kind == "dynamic" else PagedCache()
            start = time.perf_counter()
            generate(model, cache, ids, mask, new_tokens)
            times[kind].append(time.perf_counter() - start)
            if kind == "paged":
                cache.release()
    return {kind: statistics.median(seconds) for kind, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    pool = hf_paged_kv.enable(model, pool=KVPool(max_bytes=512 << 20))
    prompts = prompts_of_lengths(tokenizer, LENGTHS, seed=0)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    n = args.new_tokens

    # (a) memory and throughput of one padded batch
    dynamic = DynamicCache()
    out_dynamic = generate(model, dynamic, ids, mask, n)
    with PagedCache() as paged:
        out_paged = generate(model, paged, ids, mask, n)
        paged_bytes, dynamic_bytes = paged_cache_bytes(paged), dynamic_cache_bytes(dynamic)
    identical = torch.equal(out_dynamic, out_paged)
    seconds = run_both(model, ids, mask, n, args.repeats)
    throughput = {k: 8 * n / s for k, s in seconds.items()}
    table_a = markdown_table(
        ["cache", "KV bytes at end", "tokens/s (8 x %d new)" % n, "identical tokens"],
        [
            ["DynamicCache", f"{dynamic_bytes:,}", f"{throughput['dynamic']:.1f}", ""],
            ["PagedCache", f"{paged_bytes:,}", f"{throughput['paged']:.1f}", "yes" if identical else "NO"],
            ["ratio paged/dynamic", f"{paged_bytes / dynamic_bytes:.2f}x (target <= 0.65x)",
             f"{throughput['paged'] / throughput['dynamic']:.2f}x", ""],
        ],
    )

    # (b) decode time per token
    rows = []
    for batch in (1, 8):
        b_ids, b_mask = (ids[-1:], mask[-1:]) if batch == 1 else (ids, mask)
        short = run_both(model, b_ids, b_mask, 1, args.repeats)
        long = run_both(model, b_ids, b_mask, n, args.repeats)
        per_token = {k: (long[k] - short[k]) / (n - 1) * 1e3 for k in long}
        rows.append([batch, f"{per_token['dynamic']:.2f}", f"{per_token['paged']:.2f}",
                     f"{per_token['paged'] / per_token['dynamic']:.3f}x (target <= 1.10x)"])
    table_b = markdown_table(["batch", "DynamicCache ms/token", "PagedCache ms/token", "ratio"], rows)

    body = (
        "### Paging: KV memory and speed (SmolLM2-135M, fp32, torch backend)\n\n"
        f"(a) 8 prompts of {LENGTHS[0]}..{LENGTHS[-1]} tokens of real text, left-padded, {n} new tokens each, "
        f"block size {pool.block_size}:\n\n{table_a}\n\n"
        f"(b) decode time per token, prompt(s) as above (batch 1: the {LENGTHS[-1]}-token prompt), "
        f"median of {args.repeats}:\n\n{table_b}"
    )
    record("bench_paging", body)


if __name__ == "__main__":
    main()
