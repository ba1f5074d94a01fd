"""Compile the Triton kernels ahead of time for an NVIDIA GPU, on a machine that has none.

The CPU tests run the kernels in Triton's interpreter, which accepts programs the GPU compiler
rejects. This check closes most of that gap without a GPU: it builds each kernel launch exactly
as the wrappers do (on `meta` tensors: shapes, strides and dtypes without data), specializes the
arguments with Triton's own launcher rules, compiles them with Triton's NVIDIA backend to PTX
and a cubin, and asks the `ptxas` shipped in the Triton wheel for registers and spills.
What it cannot tell is whether the cubin computes the right answer or how fast: that takes
`bench/gpu_check.py` on a GPU.

    python -m hf_paged_kv.kernels.compile_check              # every variant, sm_90 (H100/H200)
    python -m hf_paged_kv.kernels.compile_check --arch 80 --quick

Triton must not be in interpreter mode (`TRITON_INTERPRET=1` replaces the compiler).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, native_specialize_impl

from .paged_decode import decode_launches
from .paged_prefill import prefill_launch, prefill_tiles
from .triton_utils import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, Launch
from .write_kv import write_kv_launch

GROUPS = (1, 4, 5, 7)
BLOCK_SIZES = (16, 32, 64)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Variant:
    dtype: torch.dtype
    head_dim: int
    group: int
    block_size: int
    num_splits: int = 4


def variants(quick: bool) -> list[Variant]:
    """Every dtype x head dim; then the group sizes, block sizes and split counts one by one."""
    dtypes = (torch.bfloat16, torch.float32) if quick else SUPPORTED_DTYPES
    head_dims = (64, 96) if quick else SUPPORTED_HEAD_DIMS
    # one split (the GPU's choice below `SPLIT_FROM` keys: the kernel writes the output) and four (split + merge)
    chosen = [Variant(dtype, head_dim, 4, 16, splits) for dtype in dtypes for head_dim in head_dims for splits in (1, 4)]
    if not quick:
        chosen += [Variant(torch.bfloat16, 128, group, 16) for group in GROUPS if group != 4]
        chosen += [Variant(torch.bfloat16, 128, 4, size) for size in BLOCK_SIZES if size != 16]
        chosen += [Variant(torch.bfloat16, 128, 4, 16, splits) for splits in (3, 64)]
    return chosen


def launches(variant: Variant, kv_heads: int = 2, batch: int = 3, new_tokens: int = 40) -> list[Launch]:
    """The launches of one decode step, one prefill and one KV write, as on a GPU, on meta tensors."""
    heads, dim = kv_heads * variant.group, variant.head_dim

    def empty(*shape, dtype=variant.dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    cache = empty(64, variant.block_size, kv_heads, dim)
    tables, kv_lens = empty(batch, 8, dtype=torch.int32), empty(batch, dtype=torch.int32)
    decode_query, prefill_query = empty(batch, heads, dim), empty(batch, heads, new_tokens, dim)
    new_kv = empty(batch, kv_heads, new_tokens, dim).transpose(1, 2)  # strided, as attention passes it
    return [
        *decode_launches(decode_query, cache, cache, tables, kv_lens, empty(batch, dtype=torch.int64),
                         0.125, None, variant.num_splits, torch.empty_like(decode_query)),
        prefill_launch(prefill_query, cache, cache, tables, kv_lens, empty(batch, new_tokens, dtype=torch.int64),
                       0.125, 4096, torch.empty_like(prefill_query),
                       tiles=prefill_tiles(variant.dtype, on_gpu=True)),
        write_kv_launch(cache, cache, new_kv, new_kv, empty(batch, new_tokens, dtype=torch.int64)),
    ]


def specialize(launch: Launch) -> ASTSource:
    """The source Triton's launcher would compile for these arguments: argument types, integers
    equal to 1 folded to constants, and 16-byte alignment/divisibility hints."""
    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise SystemExit("compile_check needs the Triton compiler: unset TRITON_INTERPRET")
    runtime_params = [param.name for param in kernel.params if not param.is_constexpr]
    signature, constants, attrs = {}, dict(launch.constexprs), {}
    for name, value in zip(runtime_params, launch.args, strict=True):
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = value
        elif key:
            attrs[(kernel.arg_names.index(name),)] = BaseBackend.parse_attr(key)
    signature.update({name: "constexpr" for name in launch.constexprs})
    return ASTSource(kernel, signature, constexprs=constants, attrs=attrs)


def launch_options(launch: Launch) -> dict:
    """The compile options the launch passes at run time."""
    return dict(num_warps=launch.num_warps, num_stages=launch.num_stages)


def ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers per thread, spilled bytes) from the ptxas bundled with Triton."""
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        result = subprocess.run(
            [triton.knobs.nvidia.ptxas.path, "-v", f"--gpu-name={arch}", str(source), "-o", str(source) + ".o"],
            capture_output=True, text=True, check=True,
        )
    registers = int(re.search(r"Used (\d+) registers", result.stderr).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill", result.stderr))
    return registers, spills


def check(arch: int, quick: bool) -> list[dict]:
    """Compile every launch of every variant once; raise on the first the compiler rejects."""
    target = GPUTarget("cuda", arch, 32)
    rows, seen = [], set()
    for variant in variants(quick):
        for launch in launches(variant):
            source = specialize(launch)
            key = (source.hash(), launch.num_warps, launch.num_stages)
            if key in seen:
                continue
            seen.add(key)
            compiled = triton.compile(source, target=target, options=launch_options(launch))
            registers, spills = ptxas_report(compiled.asm["ptx"])
            rows.append(dict(
                kernel=launch.kernel.__name__.strip("_"), dtype=DTYPE_NAMES[variant.dtype], head_dim=variant.head_dim,
                group=variant.group, block=variant.block_size, splits=variant.num_splits,
                shared_bytes=compiled.metadata.shared, registers=registers, spill_bytes=spills
            ))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200, 80: A100)")
    parser.add_argument("--quick", action="store_true", help="two dtypes and two head dims only")
    args = parser.parse_args(argv)
    rows = check(args.arch, args.quick)
    print(f"triton {triton.__version__}, sm_{args.arch}: {len(rows)} kernel variants compiled to cubin")
    print("  ".join(rows[0]))
    for row in rows:
        print("  ".join(str(value) for value in row.values()))
    spilling = [row for row in rows if row["spill_bytes"]]
    if spilling:
        print(f"{len(spilling)} variants spill registers to local memory", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
