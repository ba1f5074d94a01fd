"""Torch reference kernels: gather the paged KV into a padded batch, then `scaled_dot_product_attention`.

These define the semantics the Triton kernels must reproduce:

- `write_kv`: token `i` of `key`/`value` goes to pool slot `slot_mapping[i]`
  (`block * block_size + offset`); a negative slot means "skip" (pad tokens).
- `paged_attention`: query position `q_pos[b, t]` of row `b` attends to that row's keys
  `0..q_pos[b, t]` (causal, physical positions) that are `< kv_lens[b]`, and with a sliding
  `window`, only to keys `k > q_pos - window`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(key_cache, value_cache, key, value, slot_mapping) -> None:
    """Scatter `key`/`value` `[N, kv_heads, head_dim]` into the pool at `slot_mapping` `[N]`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    heads, dim = key_cache.shape[-2:]
    key_cache.view(-1, heads, dim).index_copy_(0, slots, key[keep].to(key_cache.dtype))
    value_cache.view(-1, heads, dim).index_copy_(0, slots, value[keep].to(value_cache.dtype))


def gather_slots(block_tables: torch.Tensor, block_size: int, max_len: int) -> torch.Tensor:
    """Pool slot of every key position `[B, max_len]`; positions past a row's blocks map to slot 0."""
    pos = torch.arange(max_len, device=block_tables.device)
    blocks = block_tables[:, pos // block_size].long().clamp_min(0)
    return blocks * block_size + pos % block_size


def attention_mask(q_pos, kv_lens, max_len: int, window: int | None = None) -> torch.Tensor:
    """Boolean `[B, 1, T, max_len]`: which key each query may attend to.

    A row with no key at all still lets its queries see key 0, so that (never read) pad outputs
    stay finite instead of NaN.
    """
    k = torch.arange(max_len, device=q_pos.device)
    q = q_pos[:, :, None]
    mask = (k <= q) & (k < kv_lens.clamp_min(1).to(q.device)[:, None, None])
    if window is not None:
        mask &= k > q - window
    return mask[:, None]


def paged_attention(
    query, key_cache, value_cache, block_tables, kv_lens, q_pos, scale, window=None, slots=None, mask=None
) -> torch.Tensor:
    """Attention of `query` `[B, heads, T, head_dim]` over the paged KV; returns the same shape.

    `slots` and `mask` may be passed precomputed (they are the same for every layer of a forward).
    """
    max_len = int(kv_lens.max()) if kv_lens.numel() else 0
    block_size = key_cache.shape[1]
    if slots is None:
        slots = gather_slots(block_tables, block_size, max(max_len, 1))
    if mask is None:
        mask = attention_mask(q_pos, kv_lens, slots.shape[1], window)
    keys, values = gather(key_cache, slots), gather(value_cache, slots)
    return sdpa(query, keys.to(query.dtype), values.to(query.dtype), mask, scale)


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy the pool slots `[B, L]` of one layer's cache into `[B, kv_heads, L, head_dim]`."""
    kv_heads, dim = cache.shape[-2:]
    rows = cache.view(-1, kv_heads, dim).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, kv_heads, dim).transpose(1, 2)


def sdpa(query, keys, values, mask, scale, is_causal=False) -> torch.Tensor:
    """SDPA over grouped-query heads. Native GQA where it is fast (no mask, or the CPU, where it
    is about 3x faster than expanding the KV heads); expanded heads for a mask on an accelerator,
    where native GQA falls back to the slow math kernel."""
    groups = query.shape[1] // keys.shape[1]
    native = mask is None or query.device.type == "cpu"
    if groups > 1 and not native:
        keys = _expand_heads(keys, groups)
        values = _expand_heads(values, groups)
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=groups > 1 and native
    )


def _expand_heads(states: torch.Tensor, groups: int) -> torch.Tensor:
    batch, heads, length, dim = states.shape
    return states[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)
