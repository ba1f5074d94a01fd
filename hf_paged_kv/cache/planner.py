"""Slot arithmetic: pure functions from sequences and new tokens to a `StepPlan`.

No model, no pool, no lock: the caller has already given each sequence the blocks its new
tokens need (`Sequence.blocks_needed`), so this is arithmetic on block tables. A `generate`
forward's planner (`forward_plan`) and the engine's packed forwards (`packed`) end here.

- `plan_batch`: a `generate` forward, `[B, T]` with an attention mask. Row `b` belongs to
  `sequences[b]`; pads are never stored, and a pad *query* sees exactly what it sees with
  `DynamicCache` (the real tokens before it), so even its output is the same.
- `plan_packed`: a serving-engine forward, many sequences' new tokens concatenated into one
  row, no pads.
- `columns_to_skip`: how many leading columns of a `generate` forward no row needs to compute.
"""

from __future__ import annotations

import numpy as np

from ..errors import PagedKVError
from .sequence import Sequence
from .step import StepPlan


def plan_batch(
    sequences: list[Sequence],
    real: np.ndarray,
    block_size: int,
    inherited: np.ndarray | None = None,
    writers: np.ndarray | None = None,
    skip: int = 0,
    logical: bool = False,
) -> StepPlan:
    """Plan a `[B, T]` forward.

    Args:
        sequences: one per row; `length` already counts the row's `inherited` tokens and
            `blocks` already cover every token this forward stores.
        real: bool `[B, T]`, the columns holding real tokens (the attention mask's tail).
        inherited: per row, how many of its leading real tokens are already stored (a reused
            prefix); they are not written again.
        writers: per row, False for a row that shares another row's blocks (an identical prompt
            in the batch): it computes its queries but writes nothing.
        skip: leading columns the forward drops (see `columns_to_skip`); queries start there.
        logical: always give logical positions (to spread attention weights over them).
    """
    batch, width = real.shape
    inherited = np.zeros(batch, dtype=np.int64) if inherited is None else np.asarray(inherited, dtype=np.int64)
    writers = np.ones(batch, dtype=bool) if writers is None else np.asarray(writers, dtype=bool)
    before = np.array([s.length for s in sequences], dtype=np.int64) - inherited  # stored before these tokens
    rank = np.cumsum(real, axis=1) - 1  # index of each real column among the row's real columns
    q_pos = before[:, None] + rank  # a pad sees the real tokens before it; -1 when there are none
    written = real & (rank >= inherited[:, None]) & writers[:, None]
    tables = _table_array(sequences)
    index = np.where(written, q_pos // block_size, 0)
    blocks = np.take_along_axis(tables, np.minimum(index, tables.shape[1] - 1), axis=1)
    _check_blocks(np.where(index < tables.shape[1], blocks, -1)[written])
    slots = np.where(written, blocks.astype(np.int64) * block_size + q_pos % block_size, -1)
    kv_lens = before + real.sum(axis=1)
    plan = StepPlan(
        batch_shape=(batch, width - skip),
        slot_mapping=slots[:, skip:].reshape(-1),
        q_start=np.arange(batch + 1, dtype=np.int64) * (width - skip),
        q_pos=q_pos[:, skip:].reshape(-1),
        block_tables=tables,
        kv_lens=kv_lens.astype(np.int32),
        contiguous=_contiguous_starts(tables, kv_lens, block_size),
        block_size=block_size,
        skip=skip,
        logical_length=sequences[0].logical_length + width if sequences else width,
    )
    if logical or _needs_logical(sequences, real):
        plan.q_logical, plan.k_logical = _logical_positions(sequences, real, before, skip)
    return plan


def plan_packed(sequences: list[Sequence], counts: list[int], block_size: int) -> StepPlan:
    """Plan a packed forward: `sequences[s]` computes its next `counts[s]` tokens, all stored,
    concatenated in order into one row of `sum(counts)` queries."""
    counts_array = np.asarray(counts, dtype=np.int64)
    starts = np.array([s.length for s in sequences], dtype=np.int64)
    q_start = np.concatenate(([0], np.cumsum(counts_array)))
    owner = np.repeat(np.arange(len(sequences)), counts_array)
    q_pos = starts[owner] + np.arange(int(q_start[-1])) - q_start[owner]
    tables = _table_array(sequences)
    blocks = tables[owner, np.minimum(q_pos // block_size, tables.shape[1] - 1)].astype(np.int64)
    _check_blocks(np.where(q_pos // block_size < tables.shape[1], blocks, -1))
    kv_lens = starts + counts_array
    return StepPlan(
        batch_shape=(1, int(q_start[-1])),
        slot_mapping=blocks * block_size + q_pos % block_size,
        q_start=q_start,
        q_pos=q_pos,
        block_tables=tables,
        kv_lens=kv_lens.astype(np.int32),
        contiguous=_contiguous_starts(tables, kv_lens, block_size),
        block_size=block_size,
    )


def columns_to_skip(real: np.ndarray, inherited: np.ndarray) -> int:
    """Leading columns of a `generate` forward that no row needs: a row needs every column from
    its first real token that is not inherited, and every row needs the last column (its logits)."""
    rank = np.cumsum(real, axis=1) - 1
    needed = real & (rank >= np.asarray(inherited)[:, None])
    needed[:, -1] = True
    return int(needed.argmax(axis=1).min()) if len(real) else 0


def _check_blocks(blocks: np.ndarray) -> None:
    if (blocks < 0).any():
        raise PagedKVError("a sequence has no block for a token this forward writes: give it blocks first "
                           "(KVPool.grow) and plan afterwards")


def _table_array(sequences: list[Sequence]) -> np.ndarray:
    width = max([1] + [len(s.blocks) for s in sequences])
    tables = np.full((len(sequences), width), -1, dtype=np.int32)
    for row, sequence in enumerate(sequences):
        tables[row, : len(sequence.blocks)] = sequence.blocks
    return tables


def _contiguous_starts(tables: np.ndarray, kv_lens: np.ndarray, block_size: int) -> np.ndarray:
    """First block of each row whose used blocks are consecutive ids, else -1."""
    starts = np.full(len(tables), -1, dtype=np.int64)
    for row, length in enumerate(kv_lens.tolist()):
        used = tables[row, : -(-length // block_size)]
        if len(used) and (len(used) == 1 or (np.diff(used) == 1).all()):
            starts[row] = used[0]
    return starts


def _needs_logical(sequences: list[Sequence], real: np.ndarray) -> bool:
    """Whether some row has a pad after a stored token, in its history or in this forward."""
    return any(sequence.gapped(row) for sequence, row in zip(sequences, real))


def _logical_positions(sequences, real, before, skip) -> tuple[np.ndarray, np.ndarray]:
    batch, width = real.shape
    logical_before = np.array([s.logical_length for s in sequences], dtype=np.int64)
    q_logical = (logical_before[:, None] + np.arange(width)[None, :])[:, skip:].reshape(-1)
    kv_lens = before + real.sum(axis=1)
    k_logical = np.zeros((batch, max(int(kv_lens.max()), 1)), dtype=np.int64)
    for row, sequence in enumerate(sequences):
        history = np.frombuffer(bytes(sequence.history), dtype=np.uint8)
        earlier = np.flatnonzero(history)[: before[row]]
        positions = np.concatenate([earlier, logical_before[row] + np.flatnonzero(real[row])])
        k_logical[row, : len(positions)] = positions
    return q_logical, k_logical
