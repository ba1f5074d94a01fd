"""Triton `paged_decode`: one query token per row against its paged KV (flash-decoding).

Grid `(batch, kv_heads, splits)`. Each program takes one KV head with all the query heads that
share it (GQA: a `[GROUP_PAD, head_dim]` query tile, so each key is read once per group), walks
its share of the row's keys in tiles of `TILE` tokens gathered through the block table, and
keeps an online softmax. A second kernel merges the splits with their log-sum-exp, so a few
long rows still spread over the whole GPU; with one split the first kernel writes the output
itself (one launch, not two: short contexts are bound by the host's launch time). Keys past `kv_lens`, after the query position,
outside the sliding window, or behind a `-1` block-table entry are never read.
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

TILE = 64  # keys per step for 16-bit caches (keys_per_tile halves it for fp32)


@triton.jit
def _decode_split_kernel(
    query, key_cache, value_cache, block_tables, kv_lens, q_pos, partial_out, partial_lse, out,
    scale, window, max_blocks,
    s_qb, s_qh, s_qd,
    s_cb, s_cs, s_ch, s_cd,
    s_ob, s_oh, s_od,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, IS_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens + row)
    position = tl.load(q_pos + row)
    hi = tl.minimum(kv_len, position + 1)
    lo = tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)
    per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), TILE) * TILE
    start = lo + split * per_split
    end = tl.minimum(start + per_split, hi)

    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + group
    head_ok = group < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        query + row * s_qb + heads[:, None] * s_qh + dims[None, :] * s_qd,
        mask=head_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for first in range(start, end, TILE):
        tokens = first + tl.arange(0, TILE)
        k, v, valid = load_kv_tile(
            key_cache, value_cache, block_tables + row * max_blocks, tokens, tokens < end, kv_head, dims, dim_ok,
            s_cb, s_cs, s_ch, s_cd, BLOCK_SIZE, UPCAST,
        )
        m_i, l_i, acc = online_softmax_step(q, k, v, valid[None, :], scale, m_i, l_i, acc, IS_FP32, SOFTCAP)

    found = l_i > 0
    result = acc / tl.where(found, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:  # the whole row: no merge
        tl.store(out + row * s_ob + heads[:, None] * s_oh + dims[None, :] * s_od, result.to(out.dtype.element_ty),
                 mask=head_ok[:, None] & dim_ok[None, :])
    else:
        lse = tl.where(found, m_i + tl.log(tl.where(found, l_i, 1.0)), float("-inf"))
        num_heads = tl.num_programs(1) * GROUP
        base = (row * num_heads + heads) * NUM_SPLITS + split
        tl.store(partial_lse + base, lse, mask=head_ok)
        tl.store(partial_out + base[:, None] * HEAD_DIM_PAD + dims[None, :], result, mask=head_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    partial_out, partial_lse, out,
    s_ob, s_oh, s_od,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_ok = splits < NUM_SPLITS
    base = (row * NUM_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(partial_lse + base, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weights = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(weights, 0)
    parts = tl.load(partial_out + base[:, None] * HEAD_DIM_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    merged = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + row * s_ob + head * s_oh + dims * s_od, merged.to(out.dtype.element_ty), mask=dims < HEAD_DIM)


SPLIT_FROM = 4096  # keys in the longest row below which one split is fastest on the GPU


def choose_splits(batch: int, kv_heads: int, max_kv_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU, each with at least a few tiles of keys; but one split
    (one launch) for rows shorter than `SPLIT_FROM`: on an H200 a call's wall time with one split
    was 47-87 us at 384-2048 keys against 84-172 us split (the merge's launch and buffers cost
    the host more than the GPU saves), while at 8192 keys splitting won, 82-188 us against
    236-270 us (`bench/tune_kernels.py`, docs/benchmarks.md)."""
    if device.type != "cuda":
        return max(1, min(4, triton.cdiv(max_kv_len, 4 * TILE)))
    if max_kv_len < SPLIT_FROM:
        return 1
    programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(programs, max(1, batch * kv_heads))
    splits = max(1, min(triton.next_power_of_2(wanted), triton.cdiv(max_kv_len, 4 * TILE), 64))
    return 1 << (splits.bit_length() - 1)  # a power of two: each count is a compiled variant (7 at most, not 64)


def paged_decode(
    query, key_cache, value_cache, block_tables, kv_lens, q_pos, scale, window=None, num_splits=None, out=None,
    softcap=None,
):
    """Decode attention. `query` `[B, heads, head_dim]`, `q_pos` `[B]`; returns `[B, heads, head_dim]`.

    Semantics are those of `reference.paged_attention` with one query per row; a row without
    any visible key gets zeros. `out` may be given (tests pass a poisoned buffer). Pass
    `num_splits` (`choose_splits` with the host's longest row): without it the split count is
    read from `kv_lens`, a wait for the GPU.
    """
    check_device(query)
    out = torch.empty_like(query) if out is None else out
    for launch in decode_launches(
        query, key_cache, value_cache, block_tables, kv_lens, q_pos, scale, window, num_splits, out, softcap
    ):
        launch.run()
    return out


def decode_launches(
    query, key_cache, value_cache, block_tables, kv_lens, q_pos, scale, window, num_splits, out, softcap=None
) -> list[Launch]:
    """The split kernel and (with more than one split) the merge kernel of one `paged_decode`
    call, arguments checked."""
    if num_splits is None:
        max_kv_len = int(kv_lens.max()) if query.shape[0] else 0
        num_splits = choose_splits(query.shape[0], key_cache.shape[2], max_kv_len, query.device)
    setup = DecodeSetup.build(query, key_cache, block_tables, kv_lens, q_pos, window, num_splits, softcap)
    return setup.launches(query, key_cache, value_cache, scale, out)


@dataclass(frozen=True)
class DecodeSetup:
    """What the `paged_decode` launches of every layer of one forward share: the rows' block
    tables, lengths and positions in the kernels' form, the split count, the compile-time
    constants and the merge's scratch buffers. Built once per forward (`build`), so each layer
    only launches (`launches`): on a GPU a decode step is bound by the host's time per layer.
    Layers may share the scratch: they run one after another on one stream."""

    rows: tuple  # (block tables, kv_lens, q_pos as int64), contiguous
    window: int
    num_splits: int
    constexprs: dict
    merge_constexprs: dict
    partial_out: torch.Tensor | None
    partial_lse: torch.Tensor | None

    @classmethod
    def build(cls, query, key_cache, block_tables, kv_lens, q_pos, window, num_splits, softcap) -> DecodeSetup:
        """For queries and caches of the shapes, strides and dtypes of `query` and `key_cache`."""
        check_inputs(query, key_cache)
        batch, heads, head_dim = query.shape
        kv_heads = key_cache.shape[2]
        group = heads // kv_heads
        group_pad = max(16, triton.next_power_of_2(group))
        dim_pad = padded_head_dim(head_dim)
        tile = keys_per_tile(TILE, query.dtype)
        check_dot_shape(group_pad, tile, dim_pad)
        partial_out = partial_lse = None
        if num_splits > 1:
            partial_out = torch.empty((batch, heads, num_splits, dim_pad), dtype=torch.float32, device=query.device)
            partial_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=query.device)
        return cls(
            rows=(block_tables.contiguous(), kv_lens.contiguous(), q_pos.to(torch.int64).contiguous()),
            window=window or 0, num_splits=num_splits,
            constexprs=dict(
                BLOCK_SIZE=key_cache.shape[1], GROUP=group, GROUP_PAD=group_pad,
                HEAD_DIM=head_dim, HEAD_DIM_PAD=dim_pad, TILE=tile, NUM_SPLITS=num_splits,
                SOFTCAP=float(softcap or 0.0), **dtype_flags(query.dtype),
            ),
            merge_constexprs=dict(
                NUM_HEADS=heads, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
                HEAD_DIM=head_dim, HEAD_DIM_PAD=dim_pad,
            ),
            partial_out=partial_out, partial_lse=partial_lse,
        )

    def launches(self, query, key_cache, value_cache, scale, out) -> list[Launch]:
        """The launches of one layer (`query` and caches shaped as those `build` saw)."""
        batch, kv_heads = query.shape[0], key_cache.shape[2]
        tables = self.rows[0]
        # with one split the kernel writes `out`, and never touches the partial buffers
        partial_out = out if self.partial_out is None else self.partial_out
        partial_lse = out if self.partial_lse is None else self.partial_lse
        split = Launch(
            _decode_split_kernel, (batch, kv_heads, self.num_splits),
            (
                query, key_cache, value_cache, *self.rows, partial_out, partial_lse, out,
                scale, self.window, tables.shape[1], *query.stride(), *key_cache.stride(), *out.stride(),
            ),
            self.constexprs,
        )
        if self.num_splits == 1:
            return [split]
        merge = Launch(
            _merge_splits_kernel, (batch, query.shape[1]), (partial_out, partial_lse, out, *out.stride()),
            self.merge_constexprs,
        )
        return [split, merge]
