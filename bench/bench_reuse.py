"""Cross-request reuse on SmolLM2-135M (fp32): what inheriting cached prefixes saves.

    python bench/bench_reuse.py [--questions 16] [--new-tokens 8]

Workloads (prompts cut from real English text with a fixed seed, see common.real_text):
1. support bot: one long system prompt, N different questions; served as N sequential
   `generate` calls and as one batched call; PagedCache (reuse on) against DynamicCache and
   against transformers' own paged continuous batching (`generate_batch`); KV bytes held;
2. multi-turn chat, 8 turns, the whole history resent each turn with a fresh cache (a
   stateless server): time of turn 8 against re-prefilling the whole history;
3. documents: 3 long documents, 4 questions each, in shuffled order: hit rate and speed-up;
4. the semantic index's extra hit tokens over the block-hash path alone (workload 3 again).
Every ratio compares figures measured in this run; outputs are checked to be identical.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import dynamic_cache_bytes, left_pad, markdown_table, paged_cache_bytes, prompts_of_lengths, record
from tqdm import tqdm
from transformers import DynamicCache, GenerationConfig

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, SemanticIndex
from hf_paged_kv.real_model import load_smollm2


def generate(model, ids, cache, new_tokens):
    ids = torch.as_tensor(ids)
    ids = ids[None] if ids.dim() == 1 else ids
    mask = torch.ones_like(ids)
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def fresh_pool(model, semantic=None, tokenizer=None):
    hf_paged_kv.disable(model)
    index = SemanticIndex(tokenizer, threshold=0.5) if semantic else None
    return hf_paged_kv.enable(model, pool=KVPool(max_bytes=768 << 20, semantic=index))


def support_bot(model, tokenizer, questions: int, new_tokens: int, system_tokens: int = 600,
                sequential_only: bool = False) -> str:
    system, *asks = prompts_of_lengths(tokenizer, [system_tokens] + [24] * questions, seed=1)
    prompts = [system + q for q in asks]
    pool = fresh_pool(model)
    rows, outputs = [], {}

    t_dyn, outputs["dynamic"] = timed(lambda: [generate(model, p, DynamicCache(), new_tokens) for p in prompts])

    def paged_sequential():
        outs = []
        for p in prompts:
            with PagedCache() as cache:
                outs.append(generate(model, p, cache, new_tokens))
        return outs

    t_pag, outputs["paged"] = timed(paged_sequential)
    hits = pool.stats()["hit_tokens_prefix"]
    same = all(torch.equal(a, b) for a, b in zip(outputs["dynamic"], outputs["paged"]))
    generated = questions * new_tokens
    rows.append([f"{questions} sequential calls", "DynamicCache", f"{generated / t_dyn:.2f}", "1.00x", "", ""])
    rows.append(["", "PagedCache (reuse)", f"{generated / t_pag:.2f}", f"{t_dyn / t_pag:.2f}x",
                 f"{hits} of {sum(map(len, prompts))}", "yes" if same else "NO"])
    title = (f"**1. Support bot**: a {system_tokens}-token system prompt, {questions} questions of 24 tokens, "
             f"{new_tokens} new tokens each")
    header = ["serving", "cache", "tokens/s", "speed vs DynamicCache", "prompt tokens inherited", "same tokens"]
    if sequential_only:
        return f"{title}, sequential calls only (target >= 3x):\n\n{markdown_table(header, rows)}"

    # one batched call: cold (nothing cached: blocks are shared after the prefill) and warm
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    batch = lambda cache: model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,  # noqa: E731
                                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    dynamic = DynamicCache()
    t_dyn_b, out_dyn_b = timed(lambda: batch(dynamic))
    dyn_bytes = dynamic_cache_bytes(dynamic)
    del dynamic
    pool = fresh_pool(model)
    with PagedCache() as cache:
        t_cold, out_cold = timed(lambda: batch(cache))
        cold_bytes = paged_cache_bytes(cache)
    cold_hits = pool.stats()["hit_tokens_prefix"]
    with PagedCache() as cache:
        t_warm, out_warm = timed(lambda: batch(cache))
        warm_bytes = paged_cache_bytes(cache)
    warm_hits = pool.stats()["hit_tokens_prefix"] - cold_hits
    same_b = torch.equal(out_dyn_b, out_cold) and torch.equal(out_dyn_b, out_warm)
    rows.append(["one batched call", "DynamicCache", f"{generated / t_dyn_b:.2f}", "1.00x", "", ""])
    rows.append(["", "PagedCache, cold pool", f"{generated / t_cold:.2f}", f"{t_dyn_b / t_cold:.2f}x", f"{cold_hits}",
                 "yes" if same_b else "NO"])
    rows.append(["", "PagedCache, warm pool", f"{generated / t_warm:.2f}", f"{t_dyn_b / t_warm:.2f}x",
                 f"{warm_hits}", "yes" if same_b else "NO"])

    # transformers' paged continuous batching on the same requests
    hf_paged_kv.disable(model)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    t_cb, _ = timed(lambda: model.generate_batch(inputs=prompts, generation_config=config))
    rows.append(["", "transformers generate_batch", f"{generated / t_cb:.2f}", f"{t_dyn_b / t_cb:.2f}x", "", ""])
    rows.append(["PagedCache sequential vs generate_batch", "", "", f"{t_cb / t_pag:.2f}x", "", ""])
    rows.append(["PagedCache warm batch vs generate_batch", "", "", f"{t_cb / t_warm:.2f}x", "", ""])

    table = markdown_table(header, rows)
    memory = markdown_table(
        ["batched call", "KV bytes at end", "ratio"],
        [["DynamicCache", f"{dyn_bytes:,}", "1.00x"],
         ["PagedCache, cold pool (shared blocks stored once)", f"{cold_bytes:,}", f"{cold_bytes / dyn_bytes:.2f}x"],
         ["PagedCache, warm pool", f"{warm_bytes:,}", f"{warm_bytes / dyn_bytes:.2f}x"]],
    )
    return (f"{title} (targets: >= 3x DynamicCache and generate_batch; KV bytes <= 0.3x):\n\n{table}\n\n{memory}")


def multi_turn(model, tokenizer, new_tokens: int) -> str:
    system, *turns = prompts_of_lengths(tokenizer, [200] + [30] * 8, seed=2)
    fresh_pool(model)
    history = list(system)
    for turn in tqdm(turns[:-1], desc="building 7 turns", leave=False):
        with PagedCache() as cache:
            out = generate(model, history + turn, cache, 24)
        history = out[0].tolist()
    final = history + turns[-1]

    def ttft(make_cache):
        cache = make_cache()
        seconds, _ = timed(lambda: generate(model, final, cache, 1))
        if isinstance(cache, PagedCache):
            cache.release()
        return seconds

    t_dyn, t_pag = ttft(DynamicCache), ttft(PagedCache)
    l_dyn, out_dyn = timed(lambda: generate(model, final, DynamicCache(), new_tokens))
    with PagedCache() as cache:
        l_pag, out_pag = timed(lambda: generate(model, final, cache, new_tokens))
    rows = [["time to first token", f"{t_dyn:.2f}", f"{t_pag:.2f}", f"{t_dyn / t_pag:.1f}x"],
            [f"whole turn ({new_tokens} new tokens)", f"{l_dyn:.2f}", f"{l_pag:.2f}", f"{l_dyn / l_pag:.1f}x"]]
    same = "identical" if torch.equal(out_dyn, out_pag) else "DIFFERENT"
    return (f"**2. Multi-turn chat**, turn 8 of a stateless chat ({len(final)}-token history resent with a fresh "
            f"cache; target >= 5x), outputs {same}:\n\n"
            + markdown_table(["turn 8", "re-prefill (DynamicCache) s", "PagedCache (reuse) s", "speed-up"], rows))


def documents(model, tokenizer, new_tokens: int, semantic: bool):
    docs = prompts_of_lengths(tokenizer, [500] * 3, seed=3)
    questions = prompts_of_lengths(tokenizer, [20] * 12, seed=4)
    requests = [docs[i // 4] + questions[i] for i in range(12)]
    random.Random(0).shuffle(requests)
    pool = fresh_pool(model, semantic, tokenizer)
    t_pag, out_pag = timed(lambda: [run_paged(model, r, new_tokens) for r in requests])
    return requests, pool.stats(), t_pag, out_pag


def run_paged(model, prompt, new_tokens):
    with PagedCache() as cache:
        return generate(model, prompt, cache, new_tokens)


def documents_table(model, tokenizer, new_tokens: int) -> tuple[str, str]:
    requests, stats, t_pag, out_pag = documents(model, tokenizer, new_tokens, semantic=False)
    t_dyn, out_dyn = timed(lambda: [generate(model, r, DynamicCache(), new_tokens) for r in requests])
    _, stats_sem, t_sem, out_sem = documents(model, tokenizer, new_tokens, semantic=True)
    same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(out_dyn, out_pag, out_sem))
    docs = markdown_table(
        ["cache", "seconds", "speed-up", "hit rate (prompt tokens)", "same tokens"],
        [["DynamicCache", f"{t_dyn:.1f}", "1.00x", "", ""],
         ["PagedCache (block hashes)", f"{t_pag:.1f}", f"{t_dyn / t_pag:.2f}x", f"{stats['hit_rate']:.0%}",
          "yes" if same else "NO"],
         ["PagedCache (+ semantic index)", f"{t_sem:.1f}", f"{t_dyn / t_sem:.2f}x", f"{stats_sem['hit_rate']:.0%}",
          "yes" if same else "NO"]],
    )
    semantic = markdown_table(
        ["path", "hit tokens", "candidates verified", "rejected by verification"],
        [["block hashes alone", stats["hit_tokens_prefix"], "", ""],
         ["block hashes with semantic index", stats_sem["hit_tokens_prefix"], "", ""],
         ["semantic index (partial blocks)", stats_sem["hit_tokens_semantic"], stats_sem["semantic_candidates"],
          stats_sem["semantic_rejected"]]],
    )
    return (f"**3. Documents**: 3 documents of 500 tokens, 4 questions each (12 requests, shuffled), {new_tokens} new "
            f"tokens:\n\n{docs}",
            "**4. Semantic index**: extra hit tokens over the block-hash path on workload 3 (all-MiniLM-L6-v2, "
            f"threshold 0.5):\n\n{semantic}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--support-only", action="store_true",
                        help="only workload 1, sequential calls (a separate section in docs/benchmarks.md)")
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    if args.support_only:
        with torch.no_grad():
            body = support_bot(model, tokenizer, args.questions, args.new_tokens, args.system_tokens, True)
        record(f"bench_reuse_support_{args.system_tokens}", "### Support bot, sequential calls "
               f"(SmolLM2-135M, fp32, torch backend)\n\n{body}")
        return
    sections = []
    with torch.no_grad():  # not inference_mode: generate_batch updates its tensors in place outside it
        for step in tqdm(["support", "multi-turn", "documents"], desc="workloads"):
            if step == "support":
                sections.append(support_bot(model, tokenizer, args.questions, args.new_tokens, args.system_tokens))
            elif step == "multi-turn":
                sections.append(multi_turn(model, tokenizer, args.new_tokens))
            else:
                sections.extend(documents_table(model, tokenizer, args.new_tokens))
    record("bench_reuse", "### Cross-request reuse (SmolLM2-135M, fp32, torch backend)\n\n" + "\n\n".join(sections))


if __name__ == "__main__":
    main()
