"""Triton building blocks shared by `paged_decode` and `paged_prefill`: gather one tile of
tokens' K and V through a row's block table, and fold it into an online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    key_cache, value_cache, row_blocks, tokens, in_range, kv_head, dims, dim_ok,
    s_cb, s_cs, s_ch, s_cd,
    BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr,
):
    """K and V `[TILE, HEAD_DIM_PAD]` of `tokens` (zeros where not loadable) and which tokens
    are valid: in range and behind a real (non -1) block-table entry. Offsets are int64."""
    block = tl.load(row_blocks + tokens // BLOCK_SIZE, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (block >= 0)
    offsets = block * s_cb + (tokens % BLOCK_SIZE) * s_cs + kv_head * s_ch
    kv_mask = valid[:, None] & dim_ok[None, :]
    k = tl.load(key_cache + offsets[:, None] + dims[None, :] * s_cd, mask=kv_mask, other=0.0)
    v = tl.load(value_cache + offsets[:, None] + dims[None, :] * s_cd, mask=kv_mask, other=0.0)
    if UPCAST:  # the interpreter's 16-bit tl.dot is wrong
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v, valid


@triton.jit
def online_softmax_step(q, k, v, visible, scale, m_i, l_i, acc, IS_FP32: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold the keys `k`/values `v` that `visible` allows into the running max `m_i`, sum
    `l_i` and accumulator `acc` (all fp32). Rows with nothing visible so far stay at zero.
    With `SOFTCAP` > 0, scores become `SOFTCAP * tanh(score / SOFTCAP)` first (Gemma-2); a
    constexpr, so models without soft-capping compile exactly as before."""
    if IS_FP32:  # fp32 must not drop to tf32 on the GPU
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * scale
    if SOFTCAP > 0:  # tanh(x) = 2 * sigmoid(2x) - 1: tl has no tanh on every release
        scores = SOFTCAP * (2.0 * tl.sigmoid(2.0 * scores / SOFTCAP) - 1.0)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IS_FP32:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc
