"""What the block size changes, measured: the figures behind `hf_paged_kv.advise_block_size`.

    python bench/bench_block_size.py            # SmolLM2-135M, fp32, torch backend
    python bench/bench_block_size.py --smoke    # toy sizes (the test suite runs this)

For block sizes 8 to 128:
1. memory lost in partial blocks, on real chat prompts of mixed lengths (SmolLM2's chat template
   around `real_text()` pieces) plus 64 generated tokens;
2. reuse lost where a shared system prompt ends inside a block (the support bot's 600 tokens);
3. bookkeeping: the host time `PagedCache` spends planning a decode step (begin + finish, no
   model) for one row of 2k tokens, per block of the row; with the model's decode step time this
   gives the advisor's `block_overhead` (bookkeeping per block in units of one token's work);
4. decode time per token at a 2k context, batch 1, on a contiguous and on a fragmented pool.

Decision (documented in docs/benchmarks.md with these figures): a live pool never changes its
block size; the advisor recommends one for the next start.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from common import (
    alternate, arguments, check_repeats, load_model, markdown_table, model_name, prompts_of_lengths,
    record,
)

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, advise_block_size
from hf_paged_kv.cache import forward_plan

SIZES = (8, 16, 32, 64, 128)


def prompt_lengths(tokenizer, smoke: bool) -> list[int]:
    """Real chat prompts of mixed lengths plus 64 generated tokens: what a chat service stores."""
    pieces = prompts_of_lengths(tokenizer, [12, 30, 55, 90, 140, 220, 400, 700] * (1 if smoke else 4), seed=3)
    if smoke:  # the stand-in tokenizer has no chat template
        return [len(p) + 64 for p in pieces]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": tokenizer.decode(p)}], tokenize=True,
                                           add_generation_prompt=True, return_dict=True)["input_ids"] for p in pieces]
    return [len(c) + 64 for c in chats]


def planning_seconds(model, size: int, context: int, steps: int) -> float:
    """Host seconds planning and committing one decode step of a row of `context` tokens take
    (`forward_plan.plan_rows` + `finish_forward`, no model): the bookkeeping that grows with the
    number of blocks."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=context // size + 64, block_size=size))
    fingerprint = hf_paged_kv.integration.hooks.current_fingerprint(model)
    cache = PagedCache(reuse=False)
    ids = torch.randint(3, 500, (1, context))
    cache.claim()
    forward_plan.plan_rows(cache, pool, fingerprint, ids, None, (1, context), False)
    cache.finish_forward()
    step = torch.randint(3, 500, (1, 1))
    start = time.perf_counter()
    for _ in range(steps):
        cache.claim()
        forward_plan.plan_rows(cache, pool, fingerprint, step, None, (1, 1), False)
        cache.finish_forward()
    seconds = (time.perf_counter() - start) / steps
    cache.release()
    hf_paged_kv.disable(model)
    return seconds


def prefill_seconds_per_token(model, tokens: int) -> float:
    """Compute time of one prompt token (a plain prefill, median of 3), the unit of `block_overhead`."""
    ids = torch.randint(3, 500, (1, tokens))
    times = []
    with torch.inference_mode():
        for _ in range(4):
            start = time.perf_counter()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            times.append(time.perf_counter() - start)
    return sorted(times[1:])[1] / tokens


def decode_ms(model, size: int, context: int, steps: int, repeats: int, fragmented: bool) -> float:
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=2 * (context // size) + 128, block_size=size))
    held = []
    if fragmented:
        taken = pool.allocate(pool.num_free())
        pool.decref(taken[1::2])
        held = taken[::2]
    cache = PagedCache(reuse=False)
    with torch.inference_mode():
        model(input_ids=torch.randint(3, 500, (1, context)), past_key_values=cache, logits_to_keep=1)
        step = torch.randint(3, 500, (1, 1))

        def run():
            start = time.perf_counter()
            for _ in range(steps):
                model(input_ids=step, past_key_values=cache)
            return time.perf_counter() - start, None

        seconds = alternate({"paged": run}, repeats)["paged"]["median"]
    cache.release()
    pool.decref(held)
    hf_paged_kv.disable(model)
    return 1000 * seconds / steps


def main(argv=None) -> None:
    args = arguments(__doc__.splitlines()[0]).parse_args(argv)
    check_repeats(args)
    model, tokenizer = load_model(args.smoke)
    context, steps = (256, 4) if args.smoke else (2048, 16)
    lengths = prompt_lengths(tokenizer, args.smoke)
    system = 600
    advice = advise_block_size(lengths, [system])
    rows, planning = [], []
    for size in SIZES:
        figures = next(r for r in advice.table if r["block_size"] == size)
        planning.append(planning_seconds(model, size, context, steps * 4))
        contiguous = decode_ms(model, size, context, steps, args.repeats, fragmented=False)
        fragmented = decode_ms(model, size, context, steps, args.repeats, fragmented=True)
        rows.append([size, f"{figures['memory_waste']:.1%}", f"{figures['reuse_loss']:.1%}",
                     f"{1e6 * planning[-1]:.0f}", f"{contiguous:.1f}", f"{fragmented:.1f}"])
    blocks = [context / size for size in SIZES]
    per_block = float(np.polyfit(blocks, planning, 1)[0])  # planning time that grows with the blocks
    overhead = per_block / prefill_seconds_per_token(model, 256 if args.smoke else 512)
    body = "\n\n".join([
        f"### Block size ({model_name(args.smoke)}, fp32, torch backend)",
        f"{len(lengths)} real chat prompts + 64 generated tokens (lengths {min(lengths)}..{max(lengths)}); a shared "
        f"system prompt of {system} tokens; decode at a {context}-token context, batch 1, {steps} steps per timed "
        f"run. Method: median of {args.repeats} runs of each block size's decode after an untimed warm-up run; the "
        "block sizes run one after another, each on its own pool, not alternated (drift between them shows in the "
        "decode columns); planning is timed once per size (a mean over steps), the advisor's columns are computed.",
        markdown_table(["block size", "memory in partial blocks", "system prompt recomputed", "planning a decode "
                        f"step of a {context}-token row, us", "decode ms/token, contiguous",
                        "decode ms/token, fragmented"], rows),
        f"Planning time grows by {1e6 * per_block:.2f} us per block of a row, {overhead:.4f} of one prompt token's "
        f"compute: that ratio is the advisor's `block_overhead`. Advice for this workload: block size "
        f"{advice.block_size}. Decision: a live pool keeps its block size (every block hash, cached prefix and kernel "
        "variant depends on it); `Engine.advise_block_size()` recommends one for the next start.",
    ])
    record("block_size", body, write=not args.smoke)


if __name__ == "__main__":
    main()
