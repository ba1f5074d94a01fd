"""Pinning and memory tiers on SmolLM2-135M (fp32, torch backend).

    python bench/bench_tiers.py

1. working set about 3x the device pool: 6 document prefixes of 256 tokens, 24 requests in
   seeded random order (prefix + a 16-token question, 4 new tokens), device pool of 40 blocks;
   reuse hit rate and tokens/s with a host tier against dropping evicted blocks;
2. restart: time to first token of the first request after a restart (fresh model object and
   pool) with the disk tier holding the persisted system prompt, against a cold start;
3. churn: a hot 256-token system prompt asked every third request among one-off 560-token
   requests, in a 56-block pool: the hot prompt's hit rate and time to first token without
   pinning, with an explicit pin, and with automatic hot-spot pinning.
Prompts are cut from real text with fixed seeds; outputs are checked against DynamicCache.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time

import torch
from common import markdown_table, prompts_of_lengths, record
from tqdm import tqdm
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache
from hf_paged_kv.real_model import load_smollm2


def generate(model, prompt, cache, new_tokens):
    ids = torch.as_tensor(prompt)[None]
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def serve(model, prompt, new_tokens):
    """(seconds, output) of one request on a fresh PagedCache."""
    start = time.perf_counter()
    with PagedCache() as cache:
        out = generate(model, prompt, cache, new_tokens)
    return time.perf_counter() - start, out


def working_set(model, tokenizer) -> str:
    docs = prompts_of_lengths(tokenizer, [256] * 6, seed=5)
    questions = prompts_of_lengths(tokenizer, [16] * 24, seed=6)
    rng = random.Random(7)
    order = [rng.randrange(6) for _ in range(24)]
    requests = [docs[d] + q for d, q in zip(order, questions)]
    rows, outputs = [], {}
    for label, host in (("drop evicted blocks", None), ("host tier (256 blocks)", 256)):
        hf_paged_kv.disable(model)
        pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=40, host_blocks=host, hot_threshold=None))
        times, outs = zip(*(serve(model, r, 4) for r in tqdm(requests, desc=label, leave=False)))
        outputs[label] = outs
        stats = pool.stats()
        rows.append([label, f"{stats['hit_rate']:.0%}", f"{24 * 4 / sum(times):.2f}", stats.get("promotions", 0),
                     stats.get("demotions", 0)])
    hf_paged_kv.disable(model)
    same = all(torch.equal(a, b) for a, b in zip(*outputs.values()))
    base = float(rows[0][2])
    for row in rows:
        row.insert(3, f"{float(row[2]) / base:.2f}x")
    return (f"**1. Working set 3x the device pool** (6 x 256-token prefixes = 96 blocks, device pool 40 blocks, "
            f"24 requests), outputs {'identical' if same else 'DIFFERENT'}:\n\n"
            + markdown_table(["device pool", "hit rate", "tokens/s", "speed-up", "promotions", "demotions"], rows))


def restart(model, tokenizer) -> str:
    system, question = prompts_of_lengths(tokenizer, [600, 20], seed=8)
    prompt = system + question
    with tempfile.TemporaryDirectory() as directory:
        hf_paged_kv.disable(model)
        hf_paged_kv.enable(model, pool=KVPool(num_blocks=256, disk_dir=directory))
        hf_paged_kv.persist(model, system)
        hf_paged_kv.disable(model)
        rows, outs = [], []
        for label, disk in (("cold start", None), ("disk tier", directory)):
            fresh, _ = load_smollm2()  # the restarted process: new model object, new pool
            pool = hf_paged_kv.enable(fresh, pool=KVPool(num_blocks=256, disk_dir=disk))
            seconds, out = serve(fresh, prompt, 1)
            outs.append(out)
            rows.append([label, f"{seconds:.2f}", pool.stats().get("disk_hits", 0)])
            hf_paged_kv.disable(fresh)
    rows[1].append(f"{float(rows[0][1]) / float(rows[1][1]):.1f}x")
    rows[0].append("1.0x")
    same = torch.equal(outs[0], outs[1])
    return (f"**2. Restart**: first request after a restart, a {len(prompt)}-token prompt whose 600-token system "
            f"prompt was persisted before; outputs {'identical' if same else 'DIFFERENT'}:\n\n"
            + markdown_table(["after restart", "time to first token s", "blocks read from disk", "speed-up"], rows))


def churn(model, tokenizer) -> str:
    hot = prompts_of_lengths(tokenizer, [256], seed=9)[0]
    one_offs = prompts_of_lengths(tokenizer, [560] * 10, seed=10)
    questions = prompts_of_lengths(tokenizer, [12] * 5, seed=11)
    schedule = []
    for i in range(15):
        schedule.append(("hot", hot + questions[i // 3]) if i % 3 == 2 else ("one-off", one_offs[i - i // 3 - 1]))
    expected = {i: generate(model, p, DynamicCache(), 2) for i, (kind, p) in enumerate(schedule) if kind == "hot"}
    rows = []
    for label in ("no pinning", "explicit pin", "automatic hot-spot pin"):
        hf_paged_kv.disable(model)
        pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=56, pin_budget=0.3,
                                                     hot_threshold=1.5 if label.startswith("auto") else None))
        if label == "explicit pin":
            hf_paged_kv.pin(model, hot)
        ttft, hits, same = [], 0, True
        for i, (kind, prompt) in enumerate(tqdm(schedule, desc=label, leave=False)):
            before = pool.stats()["hit_tokens_prefix"]
            seconds, out = serve(model, prompt, 2 if kind == "hot" else 1)
            if kind == "hot":
                ttft.append(seconds)
                hits += pool.stats()["hit_tokens_prefix"] - before >= 240
                same &= torch.equal(out, expected[i])
        pins = [p["reason"] for p in pool.stats()["pins"]]
        rows.append([label, f"{hits}/{len(ttft)}", f"{statistics.median(ttft):.2f}", ", ".join(pins) or "-",
                     "yes" if same else "NO"])
    hf_paged_kv.disable(model)
    return ("**3. Churn**: a hot 256-token system prompt every third request among one-off 560-token requests, "
            "56-block pool (pin budget 30%):\n\n"
            + markdown_table(["policy", "hot prompt reused", "hot request time s (median)", "pins at the end",
                              "same tokens"], rows))


def main() -> None:
    model, tokenizer = load_smollm2()
    sections = []
    with torch.inference_mode():
        for step in tqdm((working_set, restart, churn), desc="workloads"):
            sections.append(step(model, tokenizer))
    record("bench_tiers", "### Pinning and tiers (SmolLM2-135M, fp32, torch backend)\n\n" + "\n\n".join(sections))


if __name__ == "__main__":
    main()
