"""A continued cache's attention mask over the positions it already holds.

`DynamicCache` keeps every position's K/V and lets each forward's mask choose what is attended,
so a later turn may mask positions an earlier one stored: a batched chat whose finished row got
pad tokens after its EOS (generate feeds them as real tokens) and whose next turn rebuilds the
mask as `ids != pad`. A `PagedCache` stores only real tokens, so such a row drops those tokens'
K/V instead (`hide`): what stays is exactly what DynamicCache still attends to, the keys keep
the positions they were computed at, and the row's later tokens continue at the positions the
caller gives them. The rewritten tail is never shared (its tokens attended to the hidden ones,
which no block hash says). A pad that a later mask unmasks was never stored: refused.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import PagedKVError
from .pool import KVPool
from .sequence import Sequence


def follow_mask(pool: KVPool, sequences: list[Sequence], attention_mask) -> None:
    """Make the rows agree with `attention_mask` over the positions they hold: stored tokens it
    now masks are dropped (`hide`); a pad it unmasks raises PagedKVError. Nothing to do without
    a mask, for a fresh cache, for a mask that covers only the new columns, or for another batch
    (refused by the caller)."""
    logical = sequences[0].logical_length if sequences else 0
    if attention_mask is None or not logical or attention_mask.shape[1] <= logical:
        return
    if attention_mask.shape[0] != len(sequences):
        return
    seen = attention_mask[:, :logical].detach().cpu().numpy().astype(bool)
    for row, sequence in enumerate(sequences):
        held = np.frombuffer(bytes(sequence.history), dtype=np.uint8).astype(bool)
        revealed = np.flatnonzero(seen[row] & ~held)
        if len(revealed):
            raise PagedKVError(
                f"the attention_mask unmasks position {int(revealed[0])} of row {row}, a pad when this PagedCache "
                "stored the row: pads are never stored, so their K/V does not exist. Keep the earlier mask there, "
                "or start a fresh PagedCache")
        hidden = np.flatnonzero(held & ~seen[row])
        if len(hidden):
            hide(pool, sequence, hidden)


def hide(pool: KVPool, sequence: Sequence, hidden: np.ndarray) -> None:
    """Drop the stored tokens at logical positions `hidden` from the row: the blocks before the
    first of them stay as they are; the tokens kept after it move into fresh blocks (allocated
    first: PoolExhaustedError changes nothing), marked unknown (-1) so they are never indexed."""
    size = pool.block_size
    with pool.locked():
        stored_index = np.cumsum(np.frombuffer(bytes(sequence.history), dtype=np.uint8)) - 1
        start = int(stored_index[hidden].min()) // size * size  # the first stored token of the first block that changes
        kept = np.setdiff1d(np.arange(start, sequence.length), stored_index[hidden])
        fresh = pool.allocate(-(-len(kept) // size), after=sequence.blocks[start // size - 1] if start else None)
        blocks = np.asarray(sequence.blocks, dtype=np.int64)
        source = blocks[kept // size] * size + kept % size
        target = np.asarray(fresh, dtype=np.int64)[np.arange(len(kept)) // size] * size + np.arange(len(kept)) % size
        for cache in (*pool.key_cache, *pool.value_cache):
            flat = cache.view(-1, *cache.shape[2:])
            flat[torch.as_tensor(target, device=cache.device)] = flat[torch.as_tensor(source, device=cache.device)]
        pool.mark_written(target)
        pool.decref(sequence.unstore(hidden, start, size))
        sequence.blocks += fresh
        sequence.tokens += [-1] * len(kept)
        sequence.length += len(kept)
