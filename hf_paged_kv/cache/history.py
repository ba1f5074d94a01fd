"""A continued cache's attention mask over the positions it already holds.

`DynamicCache` keeps every position's K/V and lets each forward's mask choose what is attended,
so a later turn may mask positions an earlier one stored: a batched chat whose finished row got
pad tokens after its EOS (generate feeds them as real tokens) and whose next turn rebuilds the
mask as `ids != pad`. A `PagedCache` stores only real tokens, so such a row drops those tokens'
K/V instead (`hide`): what stays is exactly what DynamicCache still attends to, the keys keep
the positions they were computed at, and the row's later tokens continue at the positions the
caller gives them. The rewritten tail is never shared (its tokens attended to the hidden ones,
which no block hash says). A pad that a later mask unmasks was never stored: refused. And a
`generate` call whose ids do not begin with the conversation the cache holds is warned about,
or refused where they are shorter (`check_continues`).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..errors import PagedKVError
from ..pool import KVPool
from .sequence import Sequence


def check_continues(sequences: list[Sequence], input_ids, attention_mask) -> None:
    """Check a `generate` call on a continued cache: transformers feeds only the ids past the
    cache's length. Fewer positions than the cache holds is refused (nothing new to feed, or a
    reshape error). Ids that differ from the stored tokens where the call's mask attends are
    warned about: the cache's K/V stay those of the stored tokens, as with DynamicCache, which
    transformers' own prompt-reuse recipe relies on (a prefix tokenized alone may end in other
    tokens than within the whole prompt), but they are also what another conversation, or an
    interrupted call's leftover token, looks like. Stored positions whose ids are unknown (-1)
    are not compared; a changed batch size is left to the planner (`forward_plan`)."""
    if not sequences or not torch.is_tensor(input_ids) or input_ids.dim() != 2 or len(input_ids) != len(sequences):
        return
    logical = sequences[0].logical_length
    if input_ids.shape[1] < logical:
        raise PagedKVError(f"input_ids hold {input_ids.shape[1]} positions, fewer than the {logical} this PagedCache "
                           "holds: pass the whole conversation so far and then the new tokens, or a fresh PagedCache")
    given = input_ids[:, :logical].detach().cpu().numpy()
    attended = (np.ones_like(given, dtype=bool) if attention_mask is None or attention_mask.shape != input_ids.shape
                else attention_mask[:, :logical].detach().cpu().numpy().astype(bool))
    for row, sequence in enumerate(sequences):
        positions = np.flatnonzero(np.frombuffer(bytes(sequence.history), dtype=np.uint8))
        stored = np.asarray(sequence.tokens, dtype=np.int64)
        differ = np.flatnonzero((stored >= 0) & attended[row, positions] & (given[row, positions] != stored))
        if len(differ):
            at = int(differ[0])
            warnings.warn(
                f"input_ids row {row} has token {int(given[row, positions[at]])} at position {int(positions[at])}, where "
                f"this PagedCache holds token {int(stored[at])}: generate attends to the held token's K/V there, as "
                "with DynamicCache. If that is not meant, pass the conversation the cache holds, a fresh PagedCache, "
                "or crop the cache first (an interrupted generate leaves the tokens of the forwards it finished)",
                UserWarning, stacklevel=4)
            return


def follow_mask(pool: KVPool, sequences: list[Sequence], attention_mask, width: int) -> None:
    """Make the rows agree with `attention_mask` over the positions they hold, before a forward
    of `width` new columns: stored tokens it now masks are dropped (`hide`); a pad it unmasks
    raises PagedKVError. All rows or none: a refusal or a full pool changes nothing. Nothing to
    do without a mask, for a fresh cache, or for a mask not as wide as the positions held plus
    the new ones: one of another width is refused (a mask of the new columns alone does not say
    what the held positions attend; a changed batch is left to `forward_plan.plan_rows`). No mask at all
    attends every position: refused where a row holds pads."""
    logical = sequences[0].logical_length if sequences else 0
    if attention_mask is None:
        padded = next((row for row, sequence in enumerate(sequences) if 0 in sequence.history), None)
        if padded is not None:
            raise PagedKVError(f"this forward has no attention_mask, which attends every position, but row {padded} "
                               "holds pads this PagedCache never stored: pass the mask")
        return
    if not logical or attention_mask.dim() != 2 or len(attention_mask) != len(sequences):
        return
    if attention_mask.shape[1] != logical + width:
        raise PagedKVError(f"the attention_mask covers {attention_mask.shape[1]} positions; this forward needs "
                           f"{logical + width}: the {logical} this PagedCache holds and the {width} new ones")
    seen = attention_mask[:, :logical].detach().cpu().numpy().astype(bool)
    hiding = []
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
            hiding.append((sequence, hidden))
    if hiding:
        hide(pool, hiding)


def hide(pool: KVPool, rows: list[tuple[Sequence, np.ndarray]]) -> None:
    """Drop from each row the stored tokens at its logical positions `hidden`: the blocks before
    the first of them stay as they are; the tokens kept after it move into fresh blocks, taken
    for every row first (PoolExhaustedError changes nothing). Kept tokens after a hidden one are
    marked unknown (-1): their K/V attended to it, which no block hash says."""
    size = pool.block_size
    with pool.locked():
        plans = []
        for sequence, hidden in rows:
            stored_index = np.cumsum(np.frombuffer(bytes(sequence.history), dtype=np.uint8)) - 1
            dropped = stored_index[hidden]
            first_hidden = int(dropped.min())
            start = first_hidden // size * size  # the first stored token of the first block that changes
            kept = np.setdiff1d(np.arange(start, sequence.length), dropped)
            plans.append((sequence, hidden, start, first_hidden, kept, -(-len(kept) // size)))
        fresh = iter(pool.allocate(sum(plan[-1] for plan in plans)))
        for sequence, hidden, start, first_hidden, kept, count in plans:
            blocks = [next(fresh) for _ in range(count)]
            source = np.asarray(sequence.blocks, dtype=np.int64)[kept // size] * size + kept % size
            target = np.asarray(blocks, dtype=np.int64)[np.arange(len(kept)) // size] * size + np.arange(len(kept)) % size
            for cache in (*pool.key_cache, *pool.value_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat[torch.as_tensor(target, device=cache.device)] = flat[torch.as_tensor(source, device=cache.device)]
            pool.mark_written(target)
            tokens = [sequence.tokens[i] if i < first_hidden else -1 for i in kept]
            pool.decref(sequence.unstore(hidden, start, size))
            sequence.blocks += blocks
            sequence.tokens += tokens
            sequence.length += len(kept)
