"""GPU check of the Triton kernels: correctness on CUDA, then timings, in one run of a few minutes.

On a GPU machine without network, from the source tree:

    python -m pip install -q --no-deps --no-build-isolation --target /tmp/site . \\
        && PYTHONPATH=/tmp/site python bench/gpu_check.py

1. runs `tests/test_kernels.py` on CUDA (every kernel against the torch reference);
2. decode with Llama-8B-like heads (32 query, 8 KV, dim 128, bf16) at batch 1/32/128 and
   context 1k/8k/32k: median time (`triton.testing.do_bench`), achieved bandwidth as a share of
   a device-to-device copy measured in the same run, and the time of
   `scaled_dot_product_attention` on the same KV stored contiguously;
3. prefill against SDPA (causal) on contiguous KV;
4. end to end: SmolLM2-135M `generate` tokens/s, PagedCache (Triton) vs DynamicCache (random
   weights of the SmolLM2 config when the GGUF package is not installed: speed does not depend
   on the weight values);
5. the host tier's CUDA path: a prompt's blocks pushed to page-locked host memory by pool
   pressure come back on the side stream bit-exact, also into a block that a still-queued
   kernel writes; and the time to first token of a host-tier hit against recomputing the prompt
   and against a device-pool hit.
It prints one table at the end and stores it in docs/benchmarks.md.

`--smoke` runs every step at toy sizes on the CPU (Triton interpreter, wall-clock timer instead
of do_bench) so the script itself is tested where no GPU is.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from common import markdown_table, record
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Triton kernel check and timings")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, to test this script")
    parser.add_argument("--skip-tests", action="store_true", help="skip step 1 (kernel tests on CUDA)")
    return parser.parse_args(argv)


def main(argv=None) -> str:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    sizes = Sizes(args.smoke)
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on the CPU")
    sections = []
    if not (args.smoke or args.skip_tests):
        sections.append(run_kernel_tests())
    copy_bw = copy_bandwidth(device, sizes)
    sections.append(decode_table(device, sizes, copy_bw))
    sections.append(prefill_table(device, sizes))
    sections.append(end_to_end_table(device, sizes))
    sections.append(host_tier_table(device, sizes))
    body = "### Triton kernels on " + machine_name(device) + "\n\n" + "\n\n".join(sections)
    if args.smoke:
        print(body)
    else:
        record("gpu_check", body)
    return body


class Sizes:
    """Benchmark shapes: the issue's on a GPU, toy ones for --smoke."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.heads, self.kv_heads, self.head_dim = (4, 2, 64) if smoke else (32, 8, 128)
        self.batches = (1, 2) if smoke else (1, 32, 128)
        self.contexts = (40, 70) if smoke else (1024, 8192, 32768)
        self.prefill = [(1, 48, 0), (2, 32, 16)] if smoke else [(1, 4096, 0), (8, 1024, 0), (4, 1024, 4096)]
        self.e2e = [(1, 16, 4)] if smoke else [(1, 256, 128), (16, 256, 128)]
        self.copy_bytes = 1 << 20 if smoke else 4 << 30
        self.tier_prompt = 40 if smoke else 4096
        self.block_size = 16


def timed(fn, smoke: bool) -> float:
    """Median milliseconds of `fn`: do_bench on the GPU, a plain timer under the interpreter."""
    if smoke:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    import triton.testing  # not under the interpreter: do_bench crashes there

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def machine_name(device: str) -> str:
    import triton

    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run, interpreter)"
    return f"{name} (torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__})"


def run_kernel_tests() -> str:
    if importlib.util.find_spec("pytest") is None:
        return ("Kernel tests on CUDA (`tests/test_kernels.py`): NOT RUN, pytest is not installed here "
                "(carry its wheels: DEVELOPERS.md, GPU checks)")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_kernels.py")]
    result = subprocess.run(command, cwd=ROOT / "tests", capture_output=True, text=True)
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(result.stdout[-3000:], result.stderr[-3000:])
    status = "passed" if result.returncode == 0 else f"FAILED (exit {result.returncode})"
    return f"Kernel tests on CUDA (`tests/test_kernels.py`): {status}: {summary}"


def copy_bandwidth(device: str, sizes: Sizes) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""

    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), sizes.smoke)
    return 2 * sizes.copy_bytes / (ms / 1e3)


def random_paged_kv(batch, context, sizes: Sizes, dtype, device):
    """A pool holding `batch` rows of `context` tokens in shuffled blocks, and the same KV contiguous."""

    blocks_per_row = -(-context // sizes.block_size)
    num_blocks = batch * blocks_per_row
    shape = (num_blocks, sizes.block_size, sizes.kv_heads, sizes.head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_row)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    flat = (tables.long()[:, :, None] * sizes.block_size + torch.arange(sizes.block_size, device=device)).flatten(1)
    flat = flat[:, :context]
    contiguous = [c.view(-1, sizes.kv_heads, sizes.head_dim)[flat].transpose(1, 2).contiguous()
                  for c in (key_cache, value_cache)]
    return key_cache, value_cache, tables, lens, contiguous


def decode_table(device: str, sizes: Sizes, copy_bw: float) -> str:

    from hf_paged_kv.kernels.paged_decode import paged_decode

    dtype = torch.float32 if sizes.smoke else torch.bfloat16
    rows = []
    for context in sizes.contexts:
        for batch in sizes.batches:
            key_cache, value_cache, tables, lens, (k, v) = random_paged_kv(batch, context, sizes, dtype, device)
            query = torch.randn(batch, sizes.heads, sizes.head_dim, dtype=dtype, device=device)
            q_pos = lens.long() - 1
            scale = sizes.head_dim**-0.5
            ours = timed(lambda: paged_decode(query, key_cache, value_cache, tables, lens, q_pos, scale), sizes.smoke)
            sdpa = timed(
                lambda: F.scaled_dot_product_attention(query[:, :, None], k, v, scale=scale, enable_gqa=True),
                sizes.smoke,
            )
            got = paged_decode(query, key_cache, value_cache, tables, lens, q_pos, scale)
            want = F.scaled_dot_product_attention(query[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]
            error = (got.float() - want.float()).abs().max().item()
            read = 2 * batch * context * sizes.kv_heads * sizes.head_dim * key_cache.element_size()
            bandwidth = read / (ours / 1e3)
            rows.append([batch, context, f"{ours:.3f}", f"{bandwidth / 1e9:.0f}", f"{100 * bandwidth / copy_bw:.0f}%",
                         f"{sdpa:.3f}", f"{sdpa / ours:.2f}x", f"{error:.1e}"])
            del key_cache, value_cache, k, v
    header = ["batch", "context", "paged_decode ms", "GB/s", "% of copy BW", "SDPA contiguous ms",
              "speed vs SDPA", "max abs err"]
    return (f"Decode ({sizes.heads} query / {sizes.kv_heads} KV heads, dim {sizes.head_dim}, {dtype}, "
            f"block {sizes.block_size}); copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write):\n\n"
            + markdown_table(header, rows))


def prefill_table(device: str, sizes: Sizes) -> str:

    from hf_paged_kv.kernels.paged_prefill import paged_prefill

    dtype = torch.float32 if sizes.smoke else torch.bfloat16
    rows = []
    for batch, new, prefix in sizes.prefill:
        key_cache, value_cache, tables, lens, (k, v) = random_paged_kv(batch, prefix + new, sizes, dtype, device)
        query = torch.randn(batch, sizes.heads, new, sizes.head_dim, dtype=dtype, device=device)
        q_pos = (prefix + torch.arange(new, device=device)).expand(batch, new).contiguous()
        scale = sizes.head_dim**-0.5
        ours = timed(lambda: paged_prefill(query, key_cache, value_cache, tables, lens, q_pos, scale), sizes.smoke)
        if prefix == 0:
            sdpa_fn = lambda: F.scaled_dot_product_attention(query, k, v, scale=scale, is_causal=True, enable_gqa=True)
        else:  # new tokens see the whole prefix: a bottom-right aligned causal mask
            keys = torch.arange(prefix + new, device=device)
            mask = keys[None, :] <= (prefix + torch.arange(new, device=device))[:, None]
            sdpa_fn = lambda: F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        sdpa = timed(sdpa_fn, sizes.smoke)
        error = (paged_prefill(query, key_cache, value_cache, tables, lens, q_pos, scale).float()
                 - sdpa_fn().float()).abs().max().item()
        rows.append([batch, new, prefix, f"{ours:.3f}", f"{sdpa:.3f}", f"{sdpa / ours:.2f}x", f"{error:.1e}"])
        del key_cache, value_cache, k, v
    header = ["batch", "new tokens", "cached prefix", "paged_prefill ms", "SDPA contiguous ms", "speed vs SDPA",
              "max abs err"]
    return "Prefill (same heads; SDPA with `is_causal`, or an explicit mask when there is a prefix):\n\n" + markdown_table(header, rows)


def end_to_end_table(device: str, sizes: Sizes) -> str:


    model, source = smollm2_for_speed(device, torch.float32 if sizes.smoke else torch.bfloat16, sizes.smoke)
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=64 if sizes.smoke else 4096), backend="triton")
    rows = []
    for batch, prompt, new in sizes.e2e:
        ids = torch.randint(100, model.config.vocab_size - 100, (batch, prompt), device=device)
        mask = torch.ones_like(ids)

        def run(make_cache):
            cache = make_cache()
            synchronize(device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                                     max_new_tokens=new, min_new_tokens=new, do_sample=False)
            synchronize(device)
            seconds = time.perf_counter() - start
            if isinstance(cache, PagedCache):
                cache.release()
            return seconds, out

        run(DynamicCache), run(PagedCache)  # warm-up: compile kernels, fill allocator caches
        dynamic, paged = [], []
        for _ in range(3):
            dynamic.append(run(DynamicCache))
            paged.append(run(PagedCache))
        same = torch.equal(dynamic[0][1], paged[0][1])
        t_dyn = statistics.median(s for s, _ in dynamic)
        t_pag = statistics.median(s for s, _ in paged)
        rows.append([batch, prompt, new, f"{batch * new / t_dyn:.0f}", f"{batch * new / t_pag:.0f}",
                     f"{t_dyn / t_pag:.2f}x", "yes" if same else "no (bf16 rounding)"])
    hf_paged_kv.disable(model)
    header = ["batch", "prompt", "new tokens", "DynamicCache tok/s", "PagedCache (triton) tok/s", "speed-up",
              "same tokens"]
    return f"End to end, SmolLM2-135M {source}, greedy `generate`, median of 3:\n\n" + markdown_table(header, rows)


def host_tier_table(device: str, sizes: Sizes) -> str:
    model, source = smollm2_for_speed(device, torch.float32, sizes.smoke)
    prompt_blocks = sizes.tier_prompt // sizes.block_size
    pool = KVPool(num_blocks=2 * prompt_blocks + 8, block_size=sizes.block_size, host_blocks=2 * prompt_blocks,
                  hot_threshold=None)
    hf_paged_kv.enable(model, pool=pool)
    prompt = torch.randint(100, model.config.vocab_size - 100, (1, sizes.tier_prompt + 8), device=device)

    def first_token(reuse: bool):
        synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode(), PagedCache(reuse=reuse) as cache:
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                                 max_new_tokens=1, do_sample=False)
        synchronize(device)
        return time.perf_counter() - start, out[0, -1].item()

    def push_to_host():
        taken = pool.allocate(pool.num_available())  # pressure: every cached block leaves the device
        pool.decref(taken)

    def straggler_on_next_free_block():
        """A kernel still queued on the forward stream writes a block that is then let go; the
        next promotion lands in that block (the free list is LIFO) and must wait for it."""
        block = pool.allocate(1)[0]
        if device == "cuda":
            torch.cuda._sleep(50_000_000)  # tens of ms of GPU time before the writes below run
        for cache in pool.key_cache + pool.value_cache:
            cache[block].fill_(float("nan"))
        pool.decref([block])
        return block

    def device_copies():
        return [torch.stack([c[pool.index.by_digest[d]] for c in pool.key_cache + pool.value_cache]) for d in digests]

    first_token(False), first_token(True)  # warm-up; the second run indexes the prompt's blocks
    digests = [digest for digest, _ in pool.index.digest_pairs("default", prompt[0].tolist(), prompt_blocks)]
    before = device_copies()
    cold = [first_token(False) for _ in range(3)]
    device_hit = [first_token(True) for _ in range(3)]
    host_hit = []
    for _ in range(3):
        push_to_host()
        host_hit.append(first_token(True))
    exact = all(torch.equal(a, b) for a, b in zip(before, device_copies()))
    push_to_host()
    straggled = straggler_on_next_free_block()
    first_token(True)
    promoted_into = [pool.index.by_digest[d] for d in digests]
    waited = straggled in promoted_into and all(torch.equal(a, b) for a, b in zip(before, device_copies()))
    pinned = all(t.is_pinned() for t in pool.host.keys) if device == "cuda" else "n/a (CPU)"
    stats = pool.stats()
    hf_paged_kv.disable(model)
    t_cold = statistics.median(t for t, _ in cold)
    rows = [[label, f"{1e3 * statistics.median(t for t, _ in runs):.1f}",
             f"{t_cold / statistics.median(t for t, _ in runs):.2f}x", runs[0][1] == cold[0][1]]
            for label, runs in (("recompute (reuse off)", cold), ("device-pool hit", device_hit),
                                ("host-tier hit", host_hit))]
    return (f"Host tier on {device}, SmolLM2-135M {source} fp32, {sizes.tier_prompt}-token prompt "
            f"({prompt_blocks} blocks x {len(pool.key_cache)} layers): promoted blocks bit-exact: "
            f"{'yes' if exact else 'NO'}; a promotion into a block a queued kernel still writes waits for it: "
            f"{'yes' if waited else 'NO'}; host memory page-locked: {pinned}; side stream: "
            f"{pool.host.stream is not None}; {stats['promotions']} promotions, "
            f"{stats['copy_bytes'] / 2**20:.0f} MiB copied between the tiers:\n\n"
            + markdown_table(["time to first token", "ms (median of 3)", "speed-up", "same token"], rows))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def smollm2_for_speed(device, dtype, smoke: bool):
    """The real SmolLM2 if its package is installed, else the same architecture with random
    weights (two layers for --smoke)."""
    if not smoke:
        try:
            from hf_paged_kv.real_model import load_smollm2

            model, _ = load_smollm2(dtype=dtype)
            return model.to(device), "(real weights)"
        except (FileNotFoundError, ImportError):
            pass
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2 if smoke else 30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, pad_token_id=2, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval(), "(its config, random weights)"


if __name__ == "__main__":
    main()
