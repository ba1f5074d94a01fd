"""Torch reference kernels: the semantics every backend must reproduce, and the building blocks of
the torch backend (so the CPU production path is this tested reference).

- `write_kv`: token `i` of `key`/`value` goes to pool slot `slot_mapping[i]`
  (`block * block_size + offset`); a negative slot means "skip" (pads, stored tokens).
- `paged_attention`: query `t` of row `b` attends to that row's stored keys `0..q_pos[b, t]`
  that are `< kv_lens[b]` (causal in stored positions); `q_pos = -1` sees nothing and gives
  zeros. With a sliding `window`, only keys less than `window` positions back are seen,
  counted in logical positions (pads included) when `q_logical`/`k_logical` are given, as
  transformers counts them, else in stored positions. With `softcap`, scores pass through
  `softcap * tanh(score / softcap)` before the softmax (Gemma-2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(key_cache, value_cache, key, value, slot_mapping) -> None:
    """Scatter `key`/`value` `[N, kv_heads, head_dim]` into the pool at `slot_mapping` `[N]`."""
    keep = torch.nonzero(slot_mapping >= 0).flatten()
    store_kv(key_cache, value_cache, key.index_select(0, keep), value.index_select(0, keep), slot_mapping[keep])


def store_kv(key_cache, value_cache, key, value, slots) -> None:
    """`key`/`value` `[N, kv_heads, head_dim]` into pool `slots` `[N]` (all valid)."""
    heads, dim = key_cache.shape[-2:]
    if key.dtype != key_cache.dtype:
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    key_cache.view(-1, heads, dim).index_copy_(0, slots.long(), key)
    value_cache.view(-1, heads, dim).index_copy_(0, slots.long(), value)


def gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int, first: int = 0) -> torch.Tensor:
    """Copy stored tokens first..length of each row of `block_tables` `[B, n]` out of one layer's
    cache into `[B, kv_heads, length - first, head_dim]`. Whole blocks are copied (a block is one
    contiguous chunk of the pool, so this runs at memory-copy speed), from the block holding
    `first`; table entries of -1, past a row's blocks, read block 0 and must be masked by the
    caller."""
    batch, size = block_tables.shape[0], cache.shape[1]
    start, end = first // size, -(-length // size)
    blocks = cache.index_select(0, block_tables[:, start:end].reshape(-1).long().clamp_min(0))
    tokens = blocks.view(batch, (end - start) * size, *cache.shape[2:])
    return tokens[:, first - start * size : length - start * size].transpose(1, 2)


def attention_mask(q_pos, kv_lens, max_len: int, window=None, q_logical=None, k_logical=None) -> torch.Tensor:
    """Boolean `[B, 1, T, max_len]`: which key each query may attend to (see the module doc)."""
    k = torch.arange(max_len, device=q_pos.device)
    q = q_pos[:, :, None]
    mask = (k <= q) & (k < kv_lens.to(q.device)[:, None, None])
    if window is not None:
        if q_logical is not None:
            mask &= k_logical[:, None, :max_len] > q_logical[:, :, None] - window
        else:
            mask &= k > q - window
    return mask[:, None]


def paged_attention(
    query, key_cache, value_cache, block_tables, kv_lens, q_pos, scale, window=None, softcap=None
) -> torch.Tensor:
    """Attention of `query` `[B, heads, T, head_dim]` over the paged KV; returns the same shape."""
    max_len = max(int(kv_lens.max()) if kv_lens.numel() else 0, 1)
    mask = attention_mask(q_pos, kv_lens, max_len, window)
    keys = gather(key_cache, block_tables, max_len).to(query.dtype)
    values = gather(value_cache, block_tables, max_len).to(query.dtype)
    return attend(query, keys, values, mask, scale, softcap)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA's additive one (0 where visible, -inf elsewhere). SDPA converts a
    boolean mask so on every call; converted once, a forward's mask serves all of its layers."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attend(query, keys, values, mask, scale, softcap=None) -> torch.Tensor:
    """`query` against gathered `keys`/`values` under `mask` (boolean, or additive without
    `softcap`): SDPA, or the explicit softmax when scores are soft-capped (SDPA cannot cap them)."""
    if softcap:
        return eager_attention(query, keys, values, mask, scale, softcap)[0]
    return sdpa(query, keys, values, mask, scale)


def sdpa(query, keys, values, mask, scale, is_causal=False) -> torch.Tensor:
    """SDPA over grouped-query heads. Native GQA where it is fast (no mask, or the CPU, where it
    is about 3x faster than expanding the KV heads); expanded heads for a mask on an accelerator,
    where native GQA falls back to the slow math kernel. Queries that see no key get zeros.

    An fp32 decode step on the CPU (one query per row) attends with each KV head's query heads
    as that head's queries, so every key is read once rather than once per query head."""
    groups = query.shape[1] // keys.shape[1]
    if groups > 1 and _decode_on_cpu(query, mask, is_causal):
        return _grouped_decode(query, keys, values, mask, scale, groups)
    native = mask is None or query.device.type == "cpu"
    if groups > 1 and not native:
        keys, values = expand_heads(keys, groups), expand_heads(values, groups)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=groups > 1 and native
    )
    if mask is not None and query.device.type != "cpu":  # some kernels give NaN where nothing is visible
        seen = mask if mask.dtype == torch.bool else mask > float("-inf")
        out = out.masked_fill(~seen.any(-1, keepdim=True), 0.0)
    return out


def _decode_on_cpu(query, mask, is_causal: bool) -> bool:
    """One fp32 query per row, on the CPU, with a mask (if any) the same for every head. Not
    in 16-bit: CPU SDPA with several query positions rounds differently from its one-query
    kernel, and across 30 layers that moved SmolLM2's bf16 logits by up to 0.75 (the greedy token
    changed at 5-50% of the decode steps of bench_decode, against none with native GQA)."""
    one_query = query.shape[2] == 1 and not is_causal
    return (query.device.type == "cpu" and query.dtype == torch.float32 and one_query
            and (mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1)))


def _grouped_decode(query, keys, values, mask, scale, groups: int) -> torch.Tensor:
    """`query` `[B, kv_heads * groups, 1, dim]` as `[B, kv_heads, groups, dim]`: query head
    `h` uses KV head `h // groups` (SDPA's GQA mapping), and with a single query position the
    group's heads are independent queries of one head. CPU SDPA parallelises over heads, each
    reading its KV head's keys; native GQA reads them once per query head. Measured on
    SmolLM2's layers (3 KV heads, groups of 3), keys in the pool's head-interleaved layout,
    2 cores, 30 layers at 8k keys: fp32 60.6 -> 43.5 ms per step."""
    batch, heads, _, dim = query.shape
    grouped = query.reshape(batch, heads // groups, groups, dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, 1, dim)


def eager_attention(query, keys, values, mask, scale, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit softmax attention: `(output, weights)`, weights `[B, heads, T, L]` (zeros where
    a query sees nothing). Used for soft-capped scores and when the weights are asked for."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = expand_heads(keys, groups), expand_heads(values, groups)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(query.dtype)
    return torch.matmul(weights, values), weights


def expand_heads(states: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return states
    batch, heads, length, dim = states.shape
    return states[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)
