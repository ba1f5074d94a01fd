"""Decode and chunked prefill on uniform rows, SmolLM2-135M, torch backend: PagedCache vs DynamicCache
at long contexts (issue 14's grid).

    python bench/bench_decode.py [--repeats 5] [--steps 16] [--dtypes fp32,bf16]
    python bench/bench_decode.py --smoke         # toy sizes, tiny random model, prints only

Rows are uniform (random token ids, no padding), so PagedCache has no padding to skip: this is
what paging itself costs or saves. `PagedCache(reuse=False)`. Sections, each for fp32 and bf16:

1. decode (one new token per row) at contexts 512, 2k, 4k, 8k with batch 1, and 512, 2k with
   batch 8, on a pool with free space (the rows' blocks as the allocator lays them out);
2. the same grid on a fragmented pool: before the paged request, every other block of the pool
   is held (`taken = pool.allocate(pool.num_free()); pool.decref(taken[1::2])`), so no two
   blocks of a row can be neighbours; the held blocks are released after the measurement;
3. a 64-token chunk of prefill after a cached prefix of 1k and 4k tokens, and a 1k-token prefill
   into an empty cache.

Method, per point: a plain forward loop, as `generate` runs it (attention mask of ones, explicit
positions, `logits_to_keep=1`). Each system (DynamicCache on a model that was never enabled;
PagedCache on an enabled copy with the same weights) prefills the context once, untimed (in
chunks of 2048 tokens; DynamicCache's prefill is cropped back and reused by section 2). Then
timed blocks of N decode steps (the same teacher-forced random tokens for both systems, so both
advance equally): one warm-up block each, then `--repeats` blocks each, alternating which system
goes first; a block's figure is its forwards' time / N, the point's figure the median over the
blocks. For chunks: each timed call is one chunk forward after the prefix, the cache cropped
back to the prefix after it (untimed). Outputs: the argmax of both systems' logits must agree at
every step (fp32: a disagreement exits 1 and writes nothing; bf16: reported), and the largest
logit difference is reported.
"""

from __future__ import annotations

import time

import torch
from common import (
    Checks,
    alternate,
    arguments,
    check_repeats,
    contiguous_runs,
    load_model,
    markdown_table,
    method,
    model_name,
    note,
)
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache

GRID = [(512, 1), (2048, 1), (4096, 1), (8192, 1), (512, 8), (2048, 8)]
CHUNK_PREFIXES, CHUNK, PREFILL = [1024, 4096], 64, 1024
SMOKE_GRID = [(64, 1), (160, 1), (64, 3)]
SMOKE_CHUNK_PREFIXES, SMOKE_CHUNK, SMOKE_PREFILL = [64, 128], 16, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LIMIT = 1.05


def forward(model, cache, ids, start: int):
    """One forward of `ids` ([batch, n]) at positions start.. (all rows real), last logits."""
    batch, n = ids.shape
    mask = torch.ones(batch, start + n, dtype=torch.long)
    positions = torch.arange(start, start + n).expand(batch, n)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                 logits_to_keep=1).logits[:, -1]


def prefill(model, cache, ids, chunk: int = 2048) -> None:
    """Store `ids` in `cache`, untimed, in chunks (bounded activation memory at 8k tokens)."""
    for start in range(0, ids.shape[1], chunk):
        forward(model, cache, ids[:, start : start + chunk], start)


class Stepper:
    """One system of a decode point: its cache, advanced by blocks of teacher-forced steps."""

    def __init__(self, model, cache, context: int, feed: torch.Tensor, steps: int):
        self.model, self.cache, self.context, self.feed, self.steps = model, cache, context, feed, steps
        self.done, self.logits = 0, []

    def block(self):
        """N decode steps: (seconds per step, None); logits of every step kept in `self.logits`."""
        seconds = 0.0
        for _ in range(self.steps):
            token = self.feed[:, self.done : self.done + 1]
            mask = torch.ones(token.shape[0], self.context + self.done + 1, dtype=torch.long)
            positions = torch.full((token.shape[0], 1), self.context + self.done)
            begin = time.perf_counter()
            out = self.model(input_ids=token, attention_mask=mask, position_ids=positions,
                             past_key_values=self.cache, logits_to_keep=1)
            seconds += time.perf_counter() - begin
            self.logits.append(out.logits[:, -1].clone())
            self.done += 1
        return seconds / self.steps, None


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[int, int, float]:
    """(steps whose argmax agree in every row, steps compared, largest |logit difference|)."""
    agree = sum(bool(torch.equal(x.argmax(-1), y.argmax(-1))) for x, y in zip(a, b))
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
    return agree, min(len(a), len(b)), diff


def layout(cache: PagedCache) -> int:
    """The most runs of consecutive block ids in one row's block table (1: contiguous)."""
    return max(contiguous_runs(table) for table in cache.block_tables())


def decode_point(model, plain, pool, ids, feed, steps, repeats, fragmented, dynamic_cache):
    """Time decode after the context `ids` for DynamicCache (`dynamic_cache`, prefilled with `ids`,
    cropped back to them afterwards) and PagedCache (prefilled here; on a fragmented pool if
    asked), both fed the tokens `feed`."""
    context = ids.shape[1]
    held = []
    if fragmented:
        taken = pool.allocate(pool.num_free())
        pool.decref(taken[1::2])
        held = taken[0::2]
    cache = PagedCache(reuse=False)
    try:
        prefill(model, cache, ids)
        runs_before = layout(cache)
        systems = {"dynamic": Stepper(plain, dynamic_cache, context, feed, steps),
                   "paged": Stepper(model, cache, context, feed, steps)}
        timed = alternate({name: s.block for name, s in systems.items()}, repeats)
        runs_after = layout(cache)
    finally:
        cache.release()
        if held:
            pool.decref(held)
        dynamic_cache.crop(context - dynamic_cache.get_seq_length())  # negative: drop the decoded tokens
    agree, compared, diff = compare(systems["dynamic"].logits, systems["paged"].logits)
    return dict(dynamic=timed["dynamic"]["median"], paged=timed["paged"]["median"], agree=agree, compared=compared,
                diff=diff, layout=f"{runs_before} → {runs_after}")


def chunk_point(model, plain, prefix, chunk, repeats, vocab, calls: int = 2):
    """A `chunk`-token forward after a cached `prefix` (prefix 0: a prefill into an empty cache)."""
    gen = torch.Generator().manual_seed(prefix * 7 + chunk)
    ids = torch.randint(3, vocab, (1, prefix + chunk), generator=gen)
    caches = {"dynamic": DynamicCache(), "paged": PagedCache(reuse=False)}
    models = {"dynamic": plain, "paged": model}
    logits = {"dynamic": [], "paged": []}
    try:
        for name in caches:
            if prefix:
                prefill(models[name], caches[name], ids[:, :prefix])  # the cached prefix, untimed

        def one(name):
            seconds = 0.0
            for _ in range(calls):
                begin = time.perf_counter()
                out = forward(models[name], caches[name], ids[:, prefix:], prefix)
                seconds += time.perf_counter() - begin
                logits[name].append(out.clone())
                if prefix:
                    caches[name].crop(-chunk)  # back to the prefix
                elif name == "paged":
                    caches[name].reset()
                else:
                    caches[name] = DynamicCache()
            return seconds / calls, None

        timed = alternate({"dynamic": lambda: one("dynamic"), "paged": lambda: one("paged")}, repeats)
    finally:
        caches["paged"].release()
    agree, compared, diff = compare(logits["dynamic"], logits["paged"])
    return dict(dynamic=timed["dynamic"]["median"], paged=timed["paged"]["median"], agree=agree, compared=compared,
                diff=diff)


def pool_blocks(grid, steps, repeats, chunk_prefixes, chunk, block_size=16) -> int:
    """Room for the largest paged request twice over (a fragmented pool frees every other block)."""
    decode = max(batch * -(-(context + (repeats + 1) * steps) // block_size) for context, batch in grid)
    chunked = -(-(max(chunk_prefixes) + chunk) // block_size)
    return 2 * max(decode, chunked) + 2 * max(batch for _, batch in grid) + 8


def ratio_cell(r: dict, limit: float = LIMIT) -> str:
    ratio = r["paged"] / r["dynamic"]
    return f"**{ratio:.3f}x**" if ratio > limit else f"{ratio:.3f}x"


def verdict(points: list[tuple[str, dict]], limit: float = LIMIT) -> str:
    """Which points exceed `limit`, said plainly."""
    over = [f"{label} ({r['paged'] / r['dynamic']:.3f}x)" for label, r in points if r["paged"] / r["dynamic"] > limit]
    if not over:
        return f"Above {limit:.2f}x: none of the {len(points)} points."
    return f"**Above {limit:.2f}x: {len(over)} of {len(points)} points**: " + ", ".join(over) + "."


def main(argv=None) -> int:
    parser = arguments(__doc__.splitlines()[0], repeats=5)
    parser.add_argument("--steps", type=int, help="decode steps per timed block (default 16; smoke 4)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    args = parser.parse_args(argv)
    check_repeats(args)
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    if not set(dtypes) <= set(DTYPES):
        raise SystemExit(f"--dtypes: choose from {', '.join(DTYPES)}")
    grid = SMOKE_GRID if args.smoke else GRID
    prefixes, chunk, prefill_tokens = ((SMOKE_CHUNK_PREFIXES, SMOKE_CHUNK, SMOKE_PREFILL) if args.smoke
                                       else (CHUNK_PREFIXES, CHUNK, PREFILL))
    steps = args.steps or (4 if args.smoke else 16)
    checks = Checks()
    decode_rows, fragmented_rows, chunk_rows = [], [], []
    decode_points, fragmented_points, chunk_points = [], [], []
    with torch.inference_mode():
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            model, _ = load_model(args.smoke, dtype)
            plain, _ = load_model(args.smoke, dtype)  # never enabled: the DynamicCache baseline
            vocab = model.config.vocab_size
            blocks = pool_blocks(grid, steps, args.repeats, prefixes, chunk)
            pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=blocks))
            for context, batch in grid:
                label = f"{dtype_name} {context}x{batch}"
                gen = torch.Generator().manual_seed(context * 16 + batch)
                ids = torch.randint(3, vocab, (batch, context), generator=gen)
                feed = torch.randint(3, vocab, (batch, (args.repeats + 1) * steps), generator=gen)
                note(f"decode {label}: prefill (DynamicCache)")
                dynamic_cache = DynamicCache()
                prefill(plain, dynamic_cache, ids)
                for fragmented, rows, points in ((False, decode_rows, decode_points),
                                                 (True, fragmented_rows, fragmented_points)):
                    note(f"decode {label}{', fragmented pool' if fragmented else ''}")
                    r = decode_point(model, plain, pool, ids, feed, steps, args.repeats, fragmented, dynamic_cache)
                    if dtype == torch.float32:
                        checks.expect(r["agree"] == r["compared"],
                                      f"decode {label}{' (fragmented)' if fragmented else ''}: argmax agrees at "
                                      f"{r['agree']} of {r['compared']} steps")
                    points.append((label, r))
                    rows.append([dtype_name, context, batch, f"{r['dynamic'] * 1e3:.1f}", f"{r['paged'] * 1e3:.1f}",
                                 ratio_cell(r), r["layout"], f"{r['agree']}/{r['compared']}", f"{r['diff']:.2e}"])
                del dynamic_cache
            for prefix in [0, *prefixes]:
                size = prefill_tokens if prefix == 0 else chunk
                label = f"{dtype_name} {size} after {prefix}" if prefix else f"{dtype_name} prefill {size}"
                note(f"prefill {label}")
                r = chunk_point(model, plain, prefix, size, args.repeats, vocab)
                if dtype == torch.float32:
                    checks.expect(r["agree"] == r["compared"],
                                  f"prefill {label}: argmax agrees in {r['agree']} of {r['compared']} calls")
                chunk_points.append((label, r))
                what = f"{size}-token chunk after a cached {prefix}-token prefix" if prefix else \
                    f"{size}-token prefill, empty cache"
                chunk_rows.append([dtype_name, what, f"{r['dynamic'] * 1e3:.1f}", f"{r['paged'] * 1e3:.1f}",
                                   ratio_cell(r), f"{r['agree']}/{r['compared']}", f"{r['diff']:.2e}"])
            hf_paged_kv.disable(model)
            del model, plain, pool

    header = ["dtype", "context", "batch", "DynamicCache ms/step", "PagedCache ms/step", "ratio paged/dynamic",
              "paged row layout: block runs, after prefill → at the end", "argmax agrees (steps)",
              "max abs logit diff"]
    m = method(args.repeats, f"; a run is a block of {steps} decode steps (one new token per row), its figure the "
                             "forwards' time / steps; both systems advance through the same blocks")
    body = (
        f"### Decode on uniform rows at long context ({model_name(args.smoke)}, torch backend, reuse off)\n\n"
        "Rows of equal length (random token ids, no padding: PagedCache has nothing to skip), "
        "`PagedCache(reuse=False)` against DynamicCache, a plain forward loop as generate runs it. "
        "These figures describe uniform rows; the padded-batch figures (where the paged side skips padding) "
        "are in the paging section. A ratio in bold exceeds 1.05x.\n\n"
        f"**1. Decode, pool with free space**:\n\n{markdown_table(header, decode_rows)}\n\n{verdict(decode_points)}\n\n"
        "**2. Decode, fragmented pool** (every other block of the pool held before the request, released after; "
        "the DynamicCache side is measured again beside it):\n\n"
        f"{markdown_table(header, fragmented_rows)}\n\n{verdict(fragmented_points)}\n\n"
        f"{m}\n\n"
        f"**3. Prefill and chunked prefill** (batch 1; each call one chunk, the cache cropped back to the prefix "
        "after it, untimed; a call's figure is the mean of 2 chunk forwards):\n\n"
        + markdown_table(["dtype", "forward", "DynamicCache ms", "PagedCache ms", "ratio paged/dynamic",
                          "argmax agrees (calls)", "max abs logit diff"], chunk_rows)
        + f"\n\n{verdict(chunk_points)} {verdict(chunk_points, 1.0)} (issue 14: prefill no worse than 1.00x after "
        "a long cached prefix)\n\n"
        + method(args.repeats, "; prefixes are prefilled once per system, untimed")
    )
    return checks.finish("bench_decode", body, args.smoke, after="bench_paging")


if __name__ == "__main__":
    raise SystemExit(main())
