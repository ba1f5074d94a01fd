"""Checks and constants shared by the Triton kernel wrappers.

Triton's CPU interpreter (`TRITON_INTERPRET=1`) differs from the GPU compiler in ways that
matter here: its bf16/fp16 `tl.dot` is wrong (so the kernels upcast tiles to fp32 under the
constexpr `UPCAST`), and it accepts `tl.dot` shapes the GPU compiler rejects (so the wrappers
check them with `check_dot_shape`, and CPU tests catch what only a GPU would).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton

from hf_paged_kv.errors import PagedKVError

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 96, 128)
MIN_DOT_DIM = 16  # smallest M, N and K the GPU compiler accepts for tl.dot


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Launch:
    """One kernel launch, described before it happens: the wrappers `run()` it, and
    `compile_check` compiles exactly these arguments for a GPU on a machine without one."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    num_warps: int = 4  # Triton's defaults on NVIDIA GPUs; the interpreter ignores both
    num_stages: int = 3

    def run(self) -> None:
        # Triton launches on the current CUDA device: with a device map, a layer's tensors may be on
        # another. Every launch's first argument is a tensor on its device; switching costs the host
        # microseconds per launch, so only when needed
        device = self.args[0].device
        switch = device.type == "cuda" and device.index != torch.cuda.current_device()
        with torch.cuda.device(device) if switch else contextlib.nullcontext():
            self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


def unsupported(query: torch.Tensor, key_cache: torch.Tensor) -> str | None:
    """Why the kernels do not implement this query and cache (None when they do)."""
    if query.dtype not in SUPPORTED_DTYPES or key_cache.dtype != query.dtype:
        return (f"Triton paged attention supports fp32/fp16/bf16 with matching query and cache dtypes, "
                f"got query {query.dtype} and cache {key_cache.dtype}")
    head_dim = query.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS or key_cache.shape[-1] != head_dim:
        return f"Triton paged attention supports head dims {SUPPORTED_HEAD_DIMS}, got {head_dim}"
    heads, kv_heads = query.shape[1], key_cache.shape[2]  # query: [B, H, D] or [B, H, T, D]
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} KV heads"
    return None


def check_inputs(query: torch.Tensor, key_cache: torch.Tensor) -> None:
    """Refuse combinations the kernels do not implement, instead of computing a wrong answer."""
    reason = unsupported(query, key_cache)
    if reason is not None:
        raise PagedKVError(reason)


def check_device(query: torch.Tensor) -> None:
    if query.device.type != "cuda" and not interpreting():
        raise PagedKVError(
            "the Triton backend needs CUDA tensors; on the CPU set TRITON_INTERPRET=1 before importing "
            "hf_paged_kv (slow, for tests) or use backend='torch'"
        )


def check_dot_shape(m: int, n: int, k: int) -> None:
    """The GPU compiler's tl.dot limits, checked on every platform."""
    if min(m, n, k) < MIN_DOT_DIM:
        raise PagedKVError(f"tl.dot tile {m}x{n}x{k} is below the GPU minimum of {MIN_DOT_DIM} per dimension")


def dtype_flags(dtype: torch.dtype) -> dict[str, bool]:
    """The attention kernels' dtype constexprs: `UPCAST` 16-bit tiles to fp32 in the interpreter
    (its 16-bit tl.dot is wrong), and `IS_FP32` so fp32 inputs never silently drop to tf32 on
    the GPU (outputs must match the reference)."""
    is_fp32 = dtype == torch.float32
    return dict(UPCAST=interpreting() and not is_fp32, IS_FP32=is_fp32)


def keys_per_tile(tokens_16bit: int, dtype: torch.dtype) -> int:
    """Key tiles hold the same bytes whatever the dtype: fp32 takes half the tokens of fp16/bf16
    (full-size fp32 tiles spill registers on sm_80 at head dim 128; see compile_check)."""
    return tokens_16bit * 2 // dtype.itemsize


def padded_head_dim(head_dim: int) -> int:
    return triton.next_power_of_2(head_dim)
