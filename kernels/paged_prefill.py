"""Triton `paged_prefill`: many new query tokens per row, causal over the row's cached prefix
and themselves.

Grid `(batch, heads, query tiles)`. Queries arrive as transformers gives them, `[B, heads, T,
head_dim]`, with `q_pos[b, t]` the physical position of each one, so rows may differ in both
prefix length and number of new tokens (varlen; a query at position -1 sees nothing). Each program
walks the keys its tile can see, `TILE` tokens at a time gathered through the block table, with
an online softmax in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_tile import load_kv_tile, online_softmax_step
from .triton_utils import (
    Launch, check_device, check_dot_shape, check_inputs, dtype_flags, keys_per_tile, padded_head_dim,
)

BLOCK_M = 32  # queries per program off the GPU's 16-bit path (the interpreter, fp32)
TILE = 32  # keys per step there for 16-bit caches (keys_per_tile halves it for fp32)


@dataclass(frozen=True)
class PrefillTiles:
    """How a prefill launch cuts its work: `block_m` queries per program, `tile` keys per step,
    and the GPU's warps per program and software-pipeline stages (the interpreter ignores both)."""

    block_m: int
    tile: int
    num_warps: int = 4
    num_stages: int = 3


def prefill_tiles(dtype: torch.dtype, on_gpu: bool) -> PrefillTiles:
    """The tiles `paged_prefill` uses. On the GPU, 16-bit caches take 64 queries x 32 keys, 4
    warps, 2 stages: of the 24 candidates `bench/tune_kernels.py` timed on an H200
    (docs/benchmarks.md, "Kernel tuning") the fastest without a cached prefix and 8% behind the
    fastest with one (128 queries, 3 stages, which spill registers at head dim 96+:
    `compile_check`); it compiles without spills for sm_80 too. fp32, kept exact for equality
    tests, and the interpreter keep 32-query tiles."""
    if on_gpu and dtype != torch.float32:
        return PrefillTiles(64, 32, num_warps=4, num_stages=2)
    return PrefillTiles(BLOCK_M, keys_per_tile(TILE, dtype))


@triton.jit
def _prefill_kernel(
    query, key_cache, value_cache, block_tables, kv_lens, q_pos, out,
    scale, window, num_new, max_blocks,
    s_qb, s_qh, s_qt, s_qd,
    s_cb, s_cs, s_ch, s_cd,
    s_ob, s_oh, s_ot, s_od,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE: tl.constexpr, UPCAST: tl.constexpr, IS_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)  # int64: head x stride and query x stride pass 2^31 on long prompts
    kv_head = head // GROUP
    # the last query tiles see the most keys: they start first, so the short ones fill the tail
    query_tile = tl.num_programs(2) - 1 - tl.program_id(2)
    queries = query_tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    query_ok = queries < num_new
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    positions = tl.load(q_pos + row * num_new + queries, mask=query_ok, other=0)
    kv_len = tl.load(kv_lens + row)
    q = tl.load(
        query + row * s_qb + head * s_qh + queries[:, None] * s_qt + dims[None, :] * s_qd,
        mask=query_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    hi = tl.minimum(kv_len, tl.max(positions, 0) + 1)
    lowest = tl.min(tl.where(query_ok, positions, hi), 0)
    lo = tl.where(window > 0, tl.maximum(lowest - window + 1, 0), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for first in range(lo, hi, TILE):
        tokens = first + tl.arange(0, TILE)
        k, v, valid = load_kv_tile(
            key_cache, value_cache, block_tables + row * max_blocks, tokens, tokens < hi, kv_head, dims, dim_ok,
            s_cb, s_cs, s_ch, s_cd, BLOCK_SIZE, UPCAST,
        )
        visible = valid[None, :] & (tokens[None, :] <= positions[:, None])
        visible = visible & ((window <= 0) | (tokens[None, :] > positions[:, None] - window))
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, scale, m_i, l_i, acc, IS_FP32, SOFTCAP)

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out + row * s_ob + head * s_oh + queries[:, None] * s_ot + dims[None, :] * s_od,
        result.to(out.dtype.element_ty),
        mask=query_ok[:, None] & dim_ok[None, :],
    )


def paged_prefill(query, key_cache, value_cache, block_tables, kv_lens, q_pos, scale, window=None, out=None,
                  softcap=None, tiles: PrefillTiles | None = None):
    """Prefill attention. `query` `[B, heads, T, head_dim]`, `q_pos` `[B, T]`; returns the query's shape.

    Semantics are those of `reference.paged_attention`; a query without any visible key gets zeros.
    `out` may be given (tests pass a poisoned buffer); `tiles` overrides `prefill_tiles` (the GPU
    check times alternatives with it).
    """
    check_device(query)
    out = torch.empty_like(query) if out is None else out
    prefill_launch(query, key_cache, value_cache, block_tables, kv_lens, q_pos, scale, window, out, softcap,
                   tiles).run()
    return out


def prefill_launch(query, key_cache, value_cache, block_tables, kv_lens, q_pos, scale, window, out,
                   softcap=None, tiles: PrefillTiles | None = None) -> Launch:
    """The kernel launch of one `paged_prefill` call, arguments checked."""
    check_inputs(query, key_cache)
    batch, heads, new, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    dim_pad = padded_head_dim(head_dim)
    tiles = tiles or prefill_tiles(query.dtype, query.is_cuda)
    check_dot_shape(tiles.block_m, tiles.tile, dim_pad)
    tables = block_tables.contiguous()
    return Launch(
        _prefill_kernel, (batch, heads, triton.cdiv(new, tiles.block_m)),
        (
            query, key_cache, value_cache, tables, kv_lens.contiguous(), q_pos.to(torch.int64).contiguous(), out,
            scale, window or 0, new, tables.shape[1],
            *query.stride(), *key_cache.stride(), *out.stride(),
        ),
        dict(
            BLOCK_SIZE=key_cache.shape[1], GROUP=heads // kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=dim_pad,
            BLOCK_M=tiles.block_m, TILE=tiles.tile, SOFTCAP=float(softcap or 0.0),
            **dtype_flags(query.dtype),
        ),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
