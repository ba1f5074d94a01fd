"""Kernel tuning on a GPU: the prefill kernel's tiles and the decode kernel's split count,
each candidate timed and checked, so the defaults in `kernels/` are chosen by measurement.

On a GPU machine (the same set-up as `bench/gpu_check.py`, whose helpers this script uses):

    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . \\
        && PYTHONPATH=/tmp/site python3 bench/tune_kernels.py

1. `paged_prefill` with every candidate `PrefillTiles` (queries per program, keys per step,
   warps, pipeline stages) on the prefill shapes of gpu_check, against fp32 attention; a
   candidate the GPU cannot launch (too much shared memory) is listed as such;
2. `paged_decode` with every split count, on Llama-8B-like heads (32/8, dim 128) and on
   SmolLM2's (9/3, dim 64) at the context lengths where launches dominate: the GPU time
   (do_bench) and the host's wall time per call when calls run back to back (what a decode step
   of `generate` waits for), against `choose_splits`' pick.

Prints two tables and writes them to docs/benchmarks.md (section `kernel_tiles`) unless `--smoke`
(toy sizes on the CPU under the Triton interpreter, for the test suite) or a check failed.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter must be chosen before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import statistics
import time

import torch

import gpu_check  # (bench/gpu_check.py: shapes, reference attention, timing)
from gpu_check import KERNEL_TOLERANCE, Sizes, markdown_table, random_paged_kv, reference_attention

WALL_CALLS = 200  # back-to-back calls per wall-clock figure


def prefill_candidates(smoke: bool):
    from hf_paged_kv.kernels.paged_prefill import PrefillTiles

    if smoke:
        return [PrefillTiles(32, 32), PrefillTiles(64, 32)]
    return [PrefillTiles(m, n, warps, stages) for m in (64, 128) for n in (32, 64, 128)
            for warps in (4, 8) for stages in (2, 3)]


def gpu_ms(fn, smoke: bool) -> float:
    fn()  # compiles this variant outside the timing
    gpu_check.synchronize("cpu" if smoke else "cuda")
    return gpu_check.timed(fn, smoke)


def wall_us(fn, smoke: bool) -> float:
    """Host wall time per call, `WALL_CALLS` calls back to back, the GPU drained at both ends."""
    calls = 2 if smoke else WALL_CALLS
    device = "cpu" if smoke else "cuda"
    gpu_check.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    gpu_check.synchronize(device)
    return (time.perf_counter() - start) / calls * 1e6


def prefill_table(sizes: Sizes, failures: list[str]) -> str:
    from hf_paged_kv.kernels.paged_prefill import paged_prefill, prefill_tiles

    dtype, device = sizes.kernel_dtype, sizes.device
    default = prefill_tiles(dtype, on_gpu=device == "cuda")
    rows = []
    for batch, new, prefix in sizes.prefill:
        key_cache, value_cache, tables, lens, (k, v) = random_paged_kv(batch, prefix + new, sizes, dtype)
        query = torch.randn(batch, sizes.heads, new, sizes.head_dim, dtype=dtype, device=device)
        q_pos = (prefix + torch.arange(new, device=device)).expand(batch, new).contiguous()
        keys = torch.arange(prefix + new, device=device)
        mask = keys[None, :] <= (prefix + torch.arange(new, device=device))[:, None]
        ref = reference_attention(query, k, v, sizes.head_dim**-0.5, mask, rows=1)
        shape_rows = []
        for tiles in prefill_candidates(sizes.smoke) + [default]:  # the default again last: the drift
            def run(tiles=tiles):
                return paged_prefill(query, key_cache, value_cache, tables, lens, q_pos, sizes.head_dim**-0.5,
                                     tiles=tiles)
            try:
                error = gpu_check.relative_error(run(), ref)
                ms = gpu_ms(run, sizes.smoke)
            except Exception as problem:  # noqa: BLE001 - e.g. OutOfResources: too much shared memory
                shape_rows.append((float("inf"), [batch, new, prefix, *describe(tiles, default), "cannot launch",
                                                  type(problem).__name__, "", ""]))
                continue
            ok = error <= KERNEL_TOLERANCE[dtype]
            if not ok:
                failures.append(f"prefill {tiles} on ({batch}, {new}, {prefix}): relative error {error:.1e}")
            shape_rows.append((ms, [batch, new, prefix, *describe(tiles, default), f"{ms:.3f}", f"{error:.1e}",
                                    "ok" if ok else "FAILED", ""]))
        best = min(ms for ms, _ in shape_rows)
        for ms, row in shape_rows:
            row[-1] = "fastest" if ms == best else f"{ms / best:.2f}x the fastest" if ms < float("inf") else ""
            rows.append(row)
    header = ["batch", "new", "prefix", "queries/program", "keys/step", "warps", "stages", "ms", "rel. err",
              "output", "note"]
    return markdown_table(header, rows)


def describe(tiles, default) -> list:
    mark = " (default)" if tiles == default else ""
    return [f"{tiles.block_m}{mark}", tiles.tile, tiles.num_warps, tiles.num_stages]


def decode_shapes(smoke: bool):
    """(label, heads, kv_heads, head_dim, batch, context)"""
    if smoke:
        return [("toy", 4, 2, 64, 1, 70)]
    return ([("8B-like", 32, 8, 128, batch, context) for batch in (1, 16) for context in (1024, 8192)]
            + [("SmolLM2", 9, 3, 64, batch, context) for batch in (1, 16) for context in (384, 2048)])


def decode_table(sizes: Sizes, failures: list[str]) -> str:
    from hf_paged_kv.kernels.paged_decode import choose_splits, paged_decode

    dtype, device = sizes.kernel_dtype, sizes.device
    rows = []
    for label, heads, kv_heads, head_dim, batch, context in decode_shapes(sizes.smoke):
        shape = Sizes(sizes.smoke)
        shape.heads, shape.kv_heads, shape.head_dim = heads, kv_heads, head_dim
        key_cache, value_cache, tables, lens, (k, v) = random_paged_kv(batch, context, shape, dtype)
        query = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
        q_pos, scale = lens.long() - 1, head_dim**-0.5
        ref = reference_attention(query[:, :, None], k, v, scale)[:, :, 0]
        picked = choose_splits(batch, kv_heads, context, torch.device(device))
        counts = [s for s in (1, 2, 4, 8, 16, 32, 64) if s == 1 or s * 64 <= context]
        for splits in counts:
            def run(splits=splits):
                return paged_decode(query, key_cache, value_cache, tables, lens, q_pos, scale, num_splits=splits)
            error = gpu_check.relative_error(run(), ref)
            if error > KERNEL_TOLERANCE[dtype]:
                failures.append(f"decode {label} batch {batch} context {context} splits {splits}: error {error:.1e}")
            walls = [wall_us(run, sizes.smoke) for _ in range(3)]
            rows.append([label, batch, context, f"{splits}{' (chosen)' if splits == picked else ''}",
                         f"{gpu_ms(run, sizes.smoke) * 1e3:.1f}", f"{statistics.median(walls):.1f}", f"{error:.1e}"])
    header = ["heads", "batch", "context", "splits", "GPU us (do_bench)", "wall us per call, back to back",
              "rel. err"]
    return markdown_table(header, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (Triton interpreter)")
    parser.add_argument("--revision", default=None, help="the commit to name in docs/benchmarks.md")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on the CPU")
    sizes, failures = Sizes(args.smoke), []
    prefill = prefill_table(sizes, failures)
    decode = decode_table(sizes, failures)
    body = (f"### Kernel tuning on {gpu_check.machine_name(sizes.device)}\n\n"
            f"Prefill tiles ({sizes.heads} query / {sizes.kv_heads} KV heads, dim {sizes.head_dim}, "
            f"{sizes.kernel_dtype}, block {sizes.block_size}). Method: median of one `do_bench` run per candidate "
            f"({gpu_check.DO_BENCH['rep']} ms of calls), candidates in a fixed order, the default timed again last "
            "to show the drift; errors against fp32 attention:\n\n" + prefill
            + "\n\nDecode split counts. GPU us: median of one `do_bench` run; wall us: median of 3 runs of "
            f"{WALL_CALLS} calls back to back (the host's launch time included, as in a decode step):\n\n"
            + decode)
    print(body)
    if failures:
        print("FAILED CHECKS (nothing written):\n" + "\n".join(failures), file=sys.stderr)
        return 1
    if not args.smoke:
        gpu_check.write_docs(body, args.revision, section="kernel_tiles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
