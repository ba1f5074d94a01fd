"""Cross-request reuse on SmolLM2-135M (fp32, torch backend): what inheriting cached prefixes saves.

    python bench/bench_reuse.py [--questions 16] [--new-tokens 8] [--repeats 3]
    python bench/bench_reuse.py --support-only --system-tokens 1500
    python bench/bench_reuse.py --smoke          # toy sizes, tiny random model, prints only

Workloads (prompts cut from real English text with fixed seeds, see common.real_text):
1. support bot: one long system prompt, N different questions, served as N sequential `generate`
   calls and as one batched call, with
   - DynamicCache (the baseline: a model that was never enabled),
   - PagedCache on a cold pool (nothing cached: in the sequential case the first request computes
     the system prompt and the others inherit it),
   - PagedCache on a warm pool: the system prompt was published (`hf_paged_kv.publish`, untimed)
     before; no question and no whole request is cached,
   - transformers' own paged continuous batching, `generate_batch` (ContinuousBatchingConfig with
     the blocks for every request), warmed up like every other system, its tokens compared with
     per-request greedy `generate` (mismatches are reported, not hidden);
   KV bytes held and the pool's reservation;
2. multi-turn chat, turn 8 of a stateless chat (the whole history resent with a fresh cache): time
   to first token and the whole turn, each measured on a pool that holds exactly what the
   previous turn stored (`clear_tenant` and the previous turn's tokens stored again before every
   run, untimed): no run inherits what another run of the measurement stored;
3. documents: 3 long documents, 4 questions each, in shuffled order: hit rate and speed-up;
4. the semantic index's extra hit tokens over the block-hash path alone (workload 3 again).

Method: every system gets one untimed warm-up run, then `--repeats` timed runs with the order of
the systems rotated every run; figures are medians and every ratio compares medians of this run.
Each PagedCache run starts from a fresh pool (or a cleared tenant). Outputs are checked against
DynamicCache token for token; a mismatch exits 1 and writes nothing.
"""

from __future__ import annotations

import random

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
    same,
    semantic_embedder,
    yes_no,
)
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, SemanticIndex
from hf_paged_kv.engine import openmp

FULL = dict(questions=16, question_tokens=24, system_tokens=600, new_tokens=8, turn_tokens=30, turn_system=200,
            turn_reply=24, doc_tokens=500, doc_question=20, pool_mib=256)
SMOKE = dict(questions=4, question_tokens=8, system_tokens=64, new_tokens=2, turn_tokens=8, turn_system=24,
             turn_reply=4, doc_tokens=48, doc_question=6, pool_mib=8)


class Bench:
    """The models, sizes and checks of one run."""

    def __init__(self, args):
        self.args, self.smoke = args, args.smoke
        self.size = dict(SMOKE if args.smoke else FULL)
        for key in ("questions", "new_tokens", "system_tokens", "pool_mib"):
            if getattr(args, key) is not None:
                self.size[key] = getattr(args, key)
        self.model, self.tokenizer = load_model(args.smoke)  # enabled, one fresh pool per measurement
        self.plain, _ = load_model(args.smoke)  # never enabled: the DynamicCache and generate_batch baseline
        self.checks = Checks()
        self.embedder = semantic_embedder(args.smoke)

    def fresh_pool(self, semantic: bool = False) -> KVPool:
        hf_paged_kv.disable(self.model)
        index = None
        if semantic:
            index = SemanticIndex(self.tokenizer, embedder=self.embedder, threshold=0.5)
            self.embedder = index.embedder  # loaded once, shared by the next indexes (not timed again)
        return hf_paged_kv.enable(self.model, pool=KVPool(max_bytes=self.size["pool_mib"] << 20, semantic=index))


# ------------------------------------------------------------------------------ support bot

def support_bot(bench: Bench, sequential_only: bool = False) -> str:
    size, model, plain, checks = bench.size, bench.model, bench.plain, bench.checks
    n, new = size["questions"], size["new_tokens"]
    system, *asks = prompts_of_lengths(bench.tokenizer, [size["system_tokens"]] + [size["question_tokens"]] * n,
                                       seed=1)
    prompts = [system + q for q in asks]
    total_prompt = sum(map(len, prompts))
    generated = n * new

    def paged_sequential(warm: bool):
        pool = bench.fresh_pool()
        if warm:
            hf_paged_kv.publish(model, system)
        before, timer, outs = pool.stats()["hit_tokens_prefix"], Timer(), []
        for prompt in prompts:
            with timer, PagedCache() as cache:
                outs.append(greedy(model, prompt, cache, new))
        return timer.seconds, dict(tokens=outs, hits=pool.stats()["hit_tokens_prefix"] - before)

    def dynamic_sequential():
        timer, outs = Timer(), []
        for prompt in prompts:
            with timer:
                outs.append(greedy(plain, prompt, DynamicCache(), new))
        return timer.seconds, dict(tokens=outs, hits=0)

    systems = {"dynamic": dynamic_sequential, "cold": lambda: paged_sequential(False),
               "warm": lambda: paged_sequential(True)}
    if not sequential_only:  # one alternation for all: ratios between them compare runs of the same rounds
        batch_systems, batch_summary = batched(bench, system, prompts)
        systems |= batch_systems
    note("support bot: sequential calls" + ("" if sequential_only else " and one batched call"))
    seq = alternate(systems, bench.args.repeats, progress="support: ")
    reference = seq["dynamic"]["outputs"][0]["tokens"]  # per-request greedy generate
    for kind in ("cold", "warm"):
        for run in seq[kind]["outputs"]:
            checks.expect(same(run["tokens"], reference), f"support bot, sequential, {kind} pool: tokens differ "
                                                           "from DynamicCache")
    rows = [[f"{n} sequential calls", "DynamicCache", f"{generated / seq['dynamic']['median']:.2f}", "1.00x", "", ""]]
    labels = {"cold": "PagedCache, cold pool", "warm": "PagedCache, warm pool (system prompt published)"}
    for kind in ("cold", "warm"):
        run = seq[kind]
        ok = all(same(r["tokens"], reference) for r in run["outputs"])
        speed = seq["dynamic"]["median"] / run["median"]
        rows.append(["", labels[kind], f"{generated / run['median']:.2f}", f"{speed:.2f}x",
                     f"{run['outputs'][0]['hits']} of {total_prompt}", yes_no(ok)])
    title = (f"**1. Support bot**: a {size['system_tokens']}-token system prompt, {n} questions of "
             f"{size['question_tokens']} tokens, {new} new tokens each")
    header = ["serving", "cache", "tokens/s", "speed vs DynamicCache", "prompt tokens inherited", "same tokens"]
    what = ("; the cold pool holds nothing when the first request starts, the warm pool only the published "
            "system prompt (published untimed before the run); tokens/s counts new tokens")
    if sequential_only:
        return (f"{title}, sequential calls only (target >= 3x):\n\n{markdown_table(header, rows)}\n\n"
                f"{method(bench.args.repeats, what)}")

    batched_rows, memory_rows, cb_note = batch_summary(seq, reference)
    rows += batched_rows
    return (f"{title} (targets: >= 3x DynamicCache and generate_batch; KV bytes <= 0.3x):\n\n"
            f"{markdown_table(header, rows)}\n\n{cb_note}\n\n"
            + markdown_table(["batched call", "KV held at the end", "ratio to DynamicCache", "note"], memory_rows)
            + f"\n\n{method(bench.args.repeats, what)}")


def batched(bench: Bench, system, prompts):
    """The same requests as one batched call, and through transformers' generate_batch: the
    systems to time, and what makes their rows of the runs (`summary(runs, reference)`)."""
    size, model, plain = bench.size, bench.model, bench.plain
    new = size["new_tokens"]
    ids, mask = left_pad(prompts, bench.tokenizer.pad_token_id)
    state = {"prompt_tokens": sum(map(len, prompts))}

    def dynamic_batch():
        cache = DynamicCache()
        with Timer() as timer:
            out = greedy(plain, ids, cache, new, mask)
        state["dynamic_bytes"] = dynamic_cache_bytes(cache)
        return timer.seconds, out

    def paged_batch(warm: bool):
        kind = "warm" if warm else "cold"
        pool = bench.fresh_pool()
        if warm:
            hf_paged_kv.publish(model, system)
        with PagedCache() as cache:
            with Timer() as timer:
                out = greedy(model, ids, cache, new, mask)
            state[f"{kind}_bytes"] = paged_cache_bytes(cache)
            # the rows' own (the pool's hit count adds the shared pre-pass's lookup of the published prompt)
            state[f"{kind}_hits"] = sum(cache.inherited)
        state[f"{kind}_stats"] = pool.stats()
        return timer.seconds, out

    # transformers' continuous batching: its own paged KV (blocks of 256 tokens by default), sized for every request
    cb_block = ContinuousBatchingConfig().block_size
    cb_blocks = sum(-(-(len(p) + new) // cb_block) for p in prompts) + 2
    cb_tokens = 512 if bench.smoke else 2048
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1,
                              pad_token_id=bench.tokenizer.pad_token_id)

    def continuous_batching():
        cb_config = ContinuousBatchingConfig(num_blocks=cb_blocks, max_batch_tokens=cb_tokens)
        # its forwards run on a thread of its own: this thread's idle OpenMP workers would slow
        # each of them by up to 1.5x (hf_paged_kv.engine.openmp), as bench_engine does for it too
        openmp.release_workers()
        with torch.no_grad():  # not inference_mode: generate_batch updates its tensors in place outside it
            with Timer() as timer:
                results = plain.generate_batch(inputs=prompts, generation_config=config,
                                               continuous_batching_config=cb_config)
        return timer.seconds, [list(r.generated_tokens) for r in results.values()]

    systems = {"dynamic batch": dynamic_batch, "cold batch": lambda: paged_batch(False),
               "warm batch": lambda: paged_batch(True), "generate_batch": continuous_batching}
    return systems, lambda runs, reference: batch_rows(bench, runs, reference, state, cb_blocks, cb_tokens)


def batch_rows(bench: Bench, runs: dict, reference, state: dict, cb_blocks: int, cb_tokens: int):
    """The batched call's rows (speed and memory) and the note on generate_batch, from `runs` of
    every system of the support bot (the sequential ones too: the same rounds)."""
    checks, n, new = bench.checks, bench.size["questions"], bench.size["new_tokens"]
    generated, cb_block = n * new, ContinuousBatchingConfig().block_size
    total_prompt = int(state["prompt_tokens"])
    dyn_out = runs["dynamic batch"]["outputs"][0]
    ok = {k: all(torch.equal(o, dyn_out) for o in runs[f"{k} batch"]["outputs"]) for k in ("cold", "warm")}
    for kind, good in ok.items():
        checks.expect(good, f"support bot, batched, {kind} pool: tokens differ from DynamicCache's batched call")

    expected = [r[0, -new:].tolist() for r in reference]  # per-request greedy generate
    cb_runs = runs["generate_batch"]["outputs"]
    mismatched = sorted({i for out in cb_runs for i in range(n) if (out[i] if i < len(out) else None) != expected[i]})
    cb_same = "yes" if not mismatched else f"NO: {len(mismatched)} of {n} requests differ"
    cb_note = ("generate_batch runs as transformers ships it: each call builds its manager and its paged KV cache "
               f"(`ContinuousBatchingConfig(num_blocks={cb_blocks}, max_batch_tokens={cb_tokens})`, prefix sharing "
               "on, `paged|sdpa` attention, switched by transformers itself), included in the call's time; the "
               "warm-up call is untimed. Its tokens against per-request greedy `generate` (DynamicCache): "
               + ("identical for every request in every run." if not mismatched else
                  f"**{len(mismatched)} of {n} requests differ** (requests {mismatched[:8]}), reported, not hidden "
                  "(packed forwards are not bit-identical to separate ones)."))

    t = {k: runs[k]["median"] for k in runs}
    dyn = t["dynamic batch"]
    rows = [["one batched call", "DynamicCache", f"{generated / dyn:.2f}", "1.00x", "", ""],
            ["", "PagedCache, cold pool", f"{generated / t['cold batch']:.2f}", f"{dyn / t['cold batch']:.2f}x",
             f"{state['cold_hits']} of {total_prompt}", yes_no(ok["cold"])],
            ["", "PagedCache, warm pool (system prompt published)", f"{generated / t['warm batch']:.2f}",
             f"{dyn / t['warm batch']:.2f}x", f"{state['warm_hits']} of {total_prompt}", yes_no(ok["warm"])],
            ["", "transformers generate_batch", f"{generated / t['generate_batch']:.2f}",
             f"{dyn / t['generate_batch']:.2f}x", "", cb_same]]
    for kind, pool in (("sequential", "cold"), ("sequential", "warm"), ("batch", "cold"), ("batch", "warm")):
        key = pool if kind == "sequential" else f"{pool} batch"
        rows.append([f"PagedCache {kind}, {pool} pool vs generate_batch", "", "",
                     f"{t['generate_batch'] / t[key]:.2f}x", "", ""])

    dyn_bytes = state["dynamic_bytes"]
    cold, warm = state["cold_stats"], state["warm_stats"]
    per_block = cold["bytes_per_block"]
    cb_per_token = per_block // cold["block_size"]
    memory = [
        ["DynamicCache", f"{dyn_bytes:,}", "1.00x", "grows with the padded batch"],
        ["PagedCache, cold pool: blocks the cache holds", f"{state['cold_bytes']:,}",
         f"{state['cold_bytes'] / dyn_bytes:.2f}x", "identical blocks of the batch stored once"],
        ["PagedCache, warm pool: blocks the cache holds", f"{state['warm_bytes']:,}",
         f"{state['warm_bytes'] / dyn_bytes:.2f}x", "including the published system prompt it shares"],
        ["PagedCache, cold pool: high-water mark of the pool", f"{cold['blocks_used_high_water'] * per_block:,}",
         f"{cold['blocks_used_high_water'] * per_block / dyn_bytes:.2f}x",
         f"{cold['blocks_used_high_water']} blocks: the smallest pool that serves this batch"],
        ["PagedCache: the pool's reservation (`bytes_total`)", f"{cold['bytes_total']:,}",
         f"{cold['bytes_total'] / dyn_bytes:.2f}x",
         f"KVPool(max_bytes={mib(bench.size['pool_mib'] << 20)}), allocated when enabled; {cold['evictions']} "
         f"evictions in the cold run, {warm['evictions']} in the warm run"],
        ["transformers generate_batch: its reservation", f"{cb_blocks * cb_block * cb_per_token:,}",
         f"{cb_blocks * cb_block * cb_per_token / dyn_bytes:.2f}x",
         f"ContinuousBatchingConfig(num_blocks={cb_blocks}, max_batch_tokens={cb_tokens}), blocks of {cb_block} "
         "tokens: every request resident at once"],
    ]
    return rows, memory, cb_note


# ------------------------------------------------------------------------------- multi-turn

def multi_turn(bench: Bench) -> str:
    size, model, plain, checks = bench.size, bench.model, bench.plain, bench.checks
    system, *turns = prompts_of_lengths(bench.tokenizer, [size["turn_system"]] + [size["turn_tokens"]] * 8, seed=2)
    note("multi-turn: building 7 turns (untimed)")
    history = list(system)
    for turn in turns[:-1]:
        history = greedy(plain, history + turn, DynamicCache(), size["turn_reply"])[0].tolist()
    final = history + turns[-1]
    stored = history[:-1]  # what turn 7 left in the pool: its prompt and reply but the last token
    pool = bench.fresh_pool()
    block = pool.block_size
    expected_inherit = len(stored) // block * block

    def paged(new_tokens):
        pool.clear_tenant("default")  # nothing of an earlier run stays
        with PagedCache() as previous, torch.inference_mode():  # the previous turn's KV, as it stored it
            model(input_ids=torch.tensor([stored]), past_key_values=previous, logits_to_keep=1)
        cached = hf_paged_kv.cached_tokens(model, final)["device"]
        with PagedCache() as cache:
            with Timer() as timer:
                out = greedy(model, final, cache, new_tokens)
            inherited = cache.inherited[0]
        return timer.seconds, dict(tokens=out, cached=cached, inherited=inherited)

    def dynamic(new_tokens):
        with Timer() as timer:
            out = greedy(plain, final, DynamicCache(), new_tokens)
        return timer.seconds, dict(tokens=out, cached=0, inherited=0)

    rows, all_same = [], True
    whole_turn = f"whole turn ({size['new_tokens']} new tokens)"
    for label, new in (("time to first token", 1), (whole_turn, size["new_tokens"])):
        note(f"multi-turn: {label}")
        runs = alternate({"dynamic": lambda n=new: dynamic(n), "paged": lambda n=new: paged(n)}, bench.args.repeats,
                         progress=f"multi-turn, {label}: ")
        reference = runs["dynamic"]["outputs"][0]["tokens"]
        outs = runs["paged"]["outputs"]
        ok = all(torch.equal(o["tokens"], reference) for o in outs)
        all_same &= ok
        checks.expect(ok, f"multi-turn, {label}: tokens differ from DynamicCache")
        checks.expect(all(o["cached"] == o["inherited"] == expected_inherit for o in outs),
                      f"multi-turn, {label}: inherited {[o['inherited'] for o in outs]} tokens, expected "
                      f"{expected_inherit} (what the previous turn stored) in every run")
        t_dyn, t_pag = runs["dynamic"]["median"], runs["paged"]["median"]
        rows.append([label, f"{t_dyn:.3f}", f"{t_pag:.3f}", f"{t_dyn / t_pag:.1f}x", outs[0]["inherited"]])
    what = ("; before every PagedCache run the tenant is cleared and the previous turn's stored tokens "
            f"({len(stored)}: its prompt and reply) are stored again, untimed, so each run inherits exactly what a "
            "stateless server holds after turn 7 and nothing a run of this measurement stored")
    return (f"**2. Multi-turn chat**, turn 8 of a stateless chat ({len(final)}-token history resent with a fresh "
            f"cache; target >= 5x), outputs {'identical' if all_same else 'DIFFERENT'}:\n\n"
            + markdown_table(["turn 8", "re-prefill (DynamicCache) s", "PagedCache (reuse) s", "speed-up",
                              "prompt tokens inherited"], rows)
            + f"\n\n{method(bench.args.repeats, what)}")


# -------------------------------------------------------------------------------- documents

def documents(bench: Bench) -> tuple[str, str]:
    size, model, plain, checks = bench.size, bench.model, bench.plain, bench.checks
    new = size["new_tokens"]
    docs = prompts_of_lengths(bench.tokenizer, [size["doc_tokens"]] * 3, seed=3)
    questions = prompts_of_lengths(bench.tokenizer, [size["doc_question"]] * 12, seed=4)
    requests = [docs[i // 4] + questions[i] for i in range(12)]
    random.Random(0).shuffle(requests)

    def paged(semantic: bool):
        pool = bench.fresh_pool(semantic)
        timer, outs = Timer(), []
        for request in requests:
            with timer, PagedCache() as cache:
                outs.append(greedy(model, request, cache, new))
        return timer.seconds, dict(tokens=outs, stats=pool.stats())

    def dynamic():
        timer, outs = Timer(), []
        for request in requests:
            with timer:
                outs.append(greedy(plain, request, DynamicCache(), new))
        return timer.seconds, dict(tokens=outs, stats=None)

    note("documents")
    runs = alternate({"dynamic": dynamic, "hashes": lambda: paged(False), "semantic": lambda: paged(True)},
                     bench.args.repeats, progress="documents: ")
    reference = runs["dynamic"]["outputs"][0]["tokens"]
    ok = {k: all(same(o["tokens"], reference) for o in runs[k]["outputs"]) for k in ("hashes", "semantic")}
    for kind, good in ok.items():
        checks.expect(good, f"documents, {kind}: tokens differ from DynamicCache")
    t = {k: runs[k]["median"] for k in runs}
    stats, stats_sem = runs["hashes"]["outputs"][-1]["stats"], runs["semantic"]["outputs"][-1]["stats"]
    table = markdown_table(
        ["cache", "seconds", "speed-up", "hit rate (prompt tokens)", "same tokens"],
        [["DynamicCache", f"{t['dynamic']:.2f}", "1.00x", "", ""],
         ["PagedCache (block hashes)", f"{t['hashes']:.2f}", f"{t['dynamic'] / t['hashes']:.2f}x",
          f"{stats['hit_rate']:.0%}", yes_no(ok["hashes"])],
         ["PagedCache (+ semantic index)", f"{t['semantic']:.2f}", f"{t['dynamic'] / t['semantic']:.2f}x",
          f"{stats_sem['hit_rate']:.0%}", yes_no(ok["semantic"])]],
    )
    semantic = markdown_table(
        ["path", "hit tokens", "candidates verified", "rejected by verification"],
        [["block hashes alone", stats["hit_tokens_prefix"], "", ""],
         ["block hashes with semantic index", stats_sem["hit_tokens_prefix"], "", ""],
         ["semantic index (partial blocks)", stats_sem["hit_tokens_semantic"], stats_sem["semantic_candidates"],
          stats_sem["semantic_rejected"]]],
    )
    embedder = "a toy hashing embedder (smoke run)" if bench.smoke else "all-MiniLM-L6-v2"
    what = "; every PagedCache run starts on a fresh pool (the 12 requests of one run share it)"
    return (f"**3. Documents**: 3 documents of {size['doc_tokens']} tokens, 4 questions each (12 requests, "
            f"shuffled), {new} new tokens:\n\n{table}\n\n{method(bench.args.repeats, what)}",
            f"**4. Semantic index**: extra hit tokens over the block-hash path on workload 3 ({embedder}, "
            f"threshold 0.5; counts of one run, the same in every run):\n\n{semantic}")


def main(argv=None) -> int:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--system-tokens", type=int)
    parser.add_argument("--pool-mib", type=int, help="the PagedCache pool's size (default 256 MiB)")
    parser.add_argument("--support-only", action="store_true",
                        help="only workload 1, sequential calls (a separate section in docs/benchmarks.md)")
    args = parser.parse_args(argv)
    check_repeats(args)
    bench = Bench(args)
    heading = f"({model_name(args.smoke)}, fp32, torch backend)"
    if args.support_only:
        body = support_bot(bench, sequential_only=True)
        return bench.checks.finish(f"bench_reuse_support_{bench.size['system_tokens']}",
                                   f"### Support bot, {bench.size['system_tokens']}-token system prompt, sequential "
                                   f"calls {heading}\n\n{body}", args.smoke)
    sections = [support_bot(bench), multi_turn(bench), *documents(bench)]
    return bench.checks.finish("bench_reuse", f"### Cross-request reuse {heading}\n\n" + "\n\n".join(sections),
                               args.smoke)


if __name__ == "__main__":
    raise SystemExit(main())
