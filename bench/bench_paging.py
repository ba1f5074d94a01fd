"""Paging on SmolLM2-135M (fp32, CPU or GPU): KV memory and speed, PagedCache vs DynamicCache.

    python bench/bench_paging.py [--new-tokens 64] [--repeats 3]

Reuse is switched off (`PagedCache(reuse=False)`): these figures are about paging alone;
bench_reuse.py measures reuse.

(a) one batch of 8 prompts of 32..512 tokens (real text, left-padded): KV bytes held at the end
    of generation and tokens/s; (b) decode time per token at batch 1 and batch 8: after the prefill, the median of N
    single-token forwards (the calls generate's decode loop makes). Both caches run
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
from tqdm import tqdm
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


def decode_ms_per_token(model, cache, ids, mask, steps):
    """Prefill, then time `steps` single-token forwards (median), as generate's decode loop runs them."""
    with torch.inference_mode():
        positions = (mask.cumsum(1) - 1).clamp_min(0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, logits_to_keep=1)
        times = []
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            positions = positions[:, -1:] + 1
            start = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        logits_to_keep=1)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_both(model, ids, mask, new_tokens, repeats):
    """Median seconds per cache kind, runs interleaved so drift hits both alike."""
    times = {"dynamic": [], "paged": []}
    for _ in tqdm(range(repeats), desc=f"batch {len(ids)}, {new_tokens} new tokens", leave=False):
        for kind in times:
            cache = DynamicCache() if kind == "dynamic" else PagedCache(reuse=False)
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
    with PagedCache(reuse=False) as paged:
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
        per_token = {"dynamic": [], "paged": []}
        for _ in tqdm(range(args.repeats), desc=f"decode, batch {batch}", leave=False):
            for kind in per_token:
                cache = DynamicCache() if kind == "dynamic" else PagedCache(reuse=False)
                per_token[kind].append(decode_ms_per_token(model, cache, b_ids, b_mask, n))
                if kind == "paged":
                    cache.release()
        dyn, pag = (statistics.median(per_token[k]) for k in ("dynamic", "paged"))
        rows.append([batch, f"{dyn:.1f}", f"{pag:.1f}", f"{pag / dyn:.3f}x (target <= 1.10x)"])
    table_b = markdown_table(["batch", "DynamicCache ms/token", "PagedCache ms/token", "ratio"], rows)

    body = (
        "### Paging: KV memory and speed (SmolLM2-135M, fp32, torch backend, reuse off)\n\n"
        f"(a) 8 prompts of {LENGTHS[0]}..{LENGTHS[-1]} tokens of real text, left-padded, {n} new tokens each, "
        f"block size {pool.block_size}:\n\n{table_a}\n\n"
        f"(b) decode time per token (median of {n} steps after the prefill; median of {args.repeats} runs), "
        f"prompt(s) as above (batch 1: the {LENGTHS[-1]}-token prompt):\n\n{table_b}"
    )
    record("bench_paging", body)


if __name__ == "__main__":
    main()
