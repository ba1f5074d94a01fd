"""Bringing a cached block back from a lower tier into the device pool: `KVPool.promote` and
`KVPool.settle`, the glue between the allocator, the tiers and the prefix index.

From the host tier a promotion is bookkeeping now and a copy later: the block is allocated (and
the index adopts it, in the walk that asked) at once, and its copy is queued, to be done in one
batch with the others of the walk (why and how: `tiers.host`). Until then the queued copy holds a
reference of its own on the block, so nothing can evict, demote, free or reuse it before its
data is there. `settle` does the copies and drops those references; the walks of
`ReuseManager` call it at their end, inside their exception handling, and the pool when its lock
is let go, so no queued copy outlives the lock. From disk a block is copied at once.
"""

from __future__ import annotations


def promote(pool, digest: bytes, model: str, after: int | None):
    """`KVPool.promote`: `(block, meta, tier)` or None."""
    with pool.locked():
        if pool.tiers.has(digest) is None or pool.num_available() < 1:
            return None
        (block,) = pool.allocate(1, after)  # may demote other blocks, and push `digest` further down
        tier = pool.tiers.has(digest)  # where the copy comes from now (counted per tier)
        pool.allocator.incref([block])  # the queued copy's reference, given back at once if none was queued
        queued = False
        try:
            meta = pool.tiers.promote(digest, model, block, pool.block_layers)
            queued = meta is not None and tier == "host"  # from the host a copy is queued, from disk done
        except BaseException:  # the copy failed (an I/O error, Ctrl-C): the block goes back
            pool.decref([block])
            raise
        finally:
            if not queued:
                pool.allocator.decref([block])
        if meta is None:
            pool.decref([block])
            return None
        pool.allocator.fill[block] = meta.fill
        return block, meta, tier


def settle(pool) -> None:
    """`KVPool.settle`: copy every queued promotion (one batch), then drop the references the
    queued copies held. If the copy fails, their blocks leave the index before the error goes on:
    their data never arrived, so no lookup may be offered them."""
    blocks = pool.tiers.queued()
    if not blocks:
        return
    try:
        pool.tiers.flush(pool.key_cache + pool.value_cache)
    except BaseException:
        index = pool.reuse.index
        index.forget([block for block in blocks if index.is_cached(block)])
        raise
    finally:
        pool.allocator.decref(blocks)
