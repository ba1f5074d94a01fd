"""Operations on a prefix's KV: publish it to every tenant, pin it in device memory, unpin it,
persist it to the disk tier. Each computes the prefix (or finds it cached) first.

    >>> hf_paged_kv.publish(model, system_prompt, tokenizer)          # every tenant may reuse it
    >>> pin = hf_paged_kv.pin(model, system_prompt, tokenizer, tenant="acme", priority=10, ttl=3600)
    >>> hf_paged_kv.unpin(model, pin)
    >>> hf_paged_kv.persist(model, system_prompt, tokenizer)          # survives a restart
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from .. import arguments
from ..arguments import PUBLIC_TENANT
from ..cache.paged_cache import PagedCache
from ..errors import PagedKVError
from ..integration.hooks import current_fingerprint, pool_of, state_of
from .pins import Pin


def publish(model, prefix, tokenizer=None) -> int:
    """Compute (or find) the KV of `prefix` and share its full blocks with every tenant.

    `prefix` is token ids (a list or 1-D tensor) or text with its `tokenizer` (no special tokens
    are added). This is the only way KV crosses tenants: use it for prompts that are public,
    such as a common system prompt. Returns the number of tokens published (whole blocks).
    """
    cache = PagedCache()
    cache.tenant = PUBLIC_TENANT  # deliberately set here: the constructor refuses it
    with _prefix_blocks(model, prefix, tokenizer, cache) as blocks:
        return len(blocks) * pool_of(model).block_size


def pin(model, prefix, tokenizer=None, tenant: str = "default", priority: int = 0, ttl: float | None = None) -> Pin:
    """Compute (or find) the KV of `prefix` for `tenant` and lock its full blocks in device
    memory: they are never evicted until `unpin` or the TTL (seconds). Returns the `Pin`.

    `prefix` is token ids or text with its `tokenizer`. Raises `PinBudgetError` when the pool's
    pin budget cannot hold it even after displacing lower-priority pins.
    """
    pool = pool_of(model)
    priority, ttl = arguments.priority(priority), arguments.seconds("ttl", ttl)
    with _prefix_blocks(model, prefix, tokenizer, PagedCache(tenant=tenant)) as blocks:
        if not blocks:
            raise ValueError(f"the prefix fills no block of {pool.block_size} tokens; nothing to pin")
        return pool.pin(blocks, tenant, priority, ttl)


def unpin(model, pin: Pin) -> None:
    """Release a pin; its blocks stay cached (evictable) for reuse. A pin already released or
    expired, or another pool's, changes nothing."""
    pool_of(model).unpin(pin)


def persist(model, prefix, tokenizer=None, tenant: str = "default") -> int:
    """Compute (or find) the KV of `prefix` and write its full blocks to the pool's disk tier
    now, so that a restarted process with the same model and directory reuses them. Returns the
    number of leading tokens whose blocks are on disk afterwards (whole blocks): fewer when a
    write failed or the disk budget could not keep them all. Blocks are written from the first;
    writing stops at the first one the disk does not keep, since a block after it could only be
    found through it (and would make room by dropping files of other prefixes for nothing)."""
    pool = pool_of(model)
    if not pool.has_disk_tier:  # refused before computing anything
        raise PagedKVError("persist needs a disk tier: KVPool(disk_dir=...)")
    with _prefix_blocks(model, prefix, tokenizer, PagedCache(tenant=tenant)) as blocks:
        return pool.persist(blocks) * pool.block_size


def cached_tokens(model, prefix, tokenizer=None, tenant: str = "default") -> dict[str, int]:
    """How many leading tokens of `prefix` a new request of `tenant` would inherit from whole
    cached blocks, by the tier each block is in now: `{"device": n, "host": n, "disk": n}`.
    Nothing is computed, moved or counted as a hit. A request whose prompt is exactly `prefix`
    computes its last token (its logits pick the first new token), so it inherits the blocks
    before the one holding that token."""
    pool, tokens = pool_of(model), np.asarray(_token_ids(prefix, tokenizer), dtype=np.int64)
    return pool.probe(current_fingerprint(model), tenant, tokens)


def _token_ids(prefix, tokenizer) -> list[int]:
    if isinstance(prefix, str):
        if tokenizer is None:
            raise ValueError("a text prefix needs its tokenizer")
        return tokenizer(prefix, add_special_tokens=False)["input_ids"]
    ids = torch.as_tensor(prefix, dtype=torch.long)
    if (ids.dim() == 2 and ids.shape[0] != 1) or ids.dim() > 2:  # [n] or [1, n], as a tokenizer returns it
        raise ValueError(f"the prefix must be one sequence of token ids, got a tensor of shape {tuple(ids.shape)}; "
                         "call once per sequence")
    return ids.reshape(-1).tolist()


@contextmanager
def _prefix_blocks(model, prefix, tokenizer, cache: PagedCache):
    """Run `prefix` (token ids, or text with its tokenizer) through `cache` on the enabled
    `model` and yield the prefix's full blocks, held by the cache until the block exits. Raises
    PagedKVError when they were not all indexed: K/V no other forward would compute is never
    shared (a model in train mode; RoPE that scales with the forward's length past its limit)."""
    pool = pool_of(model)
    ids = torch.tensor([_token_ids(prefix, tokenizer)], dtype=torch.long, device=model.device)
    if ids.shape[1] == 0:
        raise ValueError("the prefix is empty")
    with cache:
        with torch.inference_mode():  # positions given: the forward may skip (inherit) what is cached already
            model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=ids.device)[None], past_key_values=cache,
                  logits_to_keep=1)
        blocks = cache.block_tables()[0][: ids.shape[1] // pool.block_size]
        shareable = pool.shareable(blocks)
        if shareable < len(blocks):
            limit = state_of(model).rope_limit
            why = ("the model is in train mode" if model.training else
                   f"the prefix reaches position {limit}, where this model's RoPE starts to scale with the forward's "
                   "length" if limit is not None and ids.shape[1] >= limit else "they could not be indexed")
            raise PagedKVError(f"only {shareable} of the prefix's {len(blocks)} full blocks can be shared: {why} "
                               "(see the README's Limitations)")
        yield blocks
