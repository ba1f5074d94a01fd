"""The Triton backend of the registered attention function: writes with `write_kv`, reads with
`paged_decode` (one new token per row) or `paged_prefill` (several)."""

from __future__ import annotations

from .paged_decode import paged_decode
from .paged_prefill import paged_prefill
from .write_kv import write_kv


def write(plan, layer: int, key_states, value_states) -> None:
    """Store the forward's new K/V (`[B, kv_heads, T, head_dim]`) at the plan's slots."""
    pool, device = plan.pool, key_states.device
    write_kv(
        pool.key_cache[layer], pool.value_cache[layer],
        key_states.transpose(1, 2), value_states.transpose(1, 2),
        plan.on("slot_mapping", device),
    )


def attention(query, layer: int, plan, scale: float, window):
    """`query` `[B, heads, T, head_dim]` against the paged KV of `layer`; same shape out."""
    pool, device = plan.pool, query.device
    caches = pool.key_cache[layer], pool.value_cache[layer]
    tables, kv_lens, q_pos = (plan.on(name, device) for name in ("block_tables", "kv_lens", "q_pos"))
    if query.shape[2] == 1:
        return paged_decode(query[:, :, 0], *caches, tables, kv_lens, q_pos[:, 0], scale, window)[:, :, None]
    return paged_prefill(query, *caches, tables, kv_lens, q_pos, scale, window)
