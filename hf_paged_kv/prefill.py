"""Preparing a `generate` forward: for a fresh batch, find identical prompts (stored once) and
attach each row's longest reusable prefix (exact block hashes, lower tiers, the semantic index);
then allocate the new tokens' blocks and plan the forward. Used by `PagedCache.begin_forward`.
"""

from __future__ import annotations

import numpy as np

from . import planner
from .errors import PoolExhaustedError
from .pool import KVPool
from .sequence import Sequence
from .step import StepPlan


def prepare_forward(pool: KVPool, sequences: list[Sequence] | None, ids: np.ndarray, real: np.ndarray,
                    reuse: tuple[str, str] | None, may_skip: bool,
                    logical: bool) -> tuple[list[Sequence], StepPlan, np.ndarray]:
    """Give `sequences` (None: a fresh batch) the blocks for the forward's tokens and plan it.

    `ids`/`real`: the forward's token ids and stored columns `[B, T]`. `reuse`: `(model
    fingerprint, tenant)` to inherit cached prefixes (a fresh batch only). `may_skip`: the
    forward may drop leading columns every row has cached. All or nothing: PoolExhaustedError
    leaves the pool and the sequences as they were. Returns the sequences, the plan and per row
    the tokens inherited.
    """
    batch = len(real)
    fresh = sequences is None
    canonical = duplicate_rows(ids, real) if fresh and (ids >= 0).all() else np.arange(batch)
    vectors = prompt_vectors(pool, ids, real, canonical) if reuse else None
    sequences = [Sequence() for _ in range(batch)] if fresh else sequences
    inherited = np.zeros(batch, dtype=np.int64)
    with pool.locked():
        if reuse:
            inherited = inherit_rows(pool, *reuse, sequences, ids, real, canonical, vectors)
        writers = canonical == np.arange(batch)
        try:
            pool.grow(sequences, np.where(writers, real.sum(axis=1) - inherited, 0))
        except PoolExhaustedError:
            if fresh:
                for sequence in sequences:
                    pool.decref(sequence.blocks)
            raise
        if fresh:
            share_duplicates(pool, sequences, canonical)
        skip = planner.columns_to_skip(real, inherited) if may_skip else 0
        plan = planner.plan_batch(sequences, real, pool.block_size, inherited, writers, skip, logical)
        pool.mark_written(plan.slot_mapping)
    return sequences, plan, inherited


def duplicate_rows(ids: np.ndarray, real: np.ndarray) -> np.ndarray:
    """For each row, the first row with the same tokens and padding (itself if none)."""
    first: dict[bytes, int] = {}
    return np.array([first.setdefault(ids[b].tobytes() + real[b].tobytes(), b) for b in range(len(ids))])


def prompt_vectors(pool: KVPool, ids: np.ndarray, real: np.ndarray, canonical: np.ndarray) -> list:
    """Each distinct prompt's sentence embedding for the semantic index (None without one).
    Runs before the pool's lock is taken: embedding is slow."""
    if pool.semantic is None:
        return [None] * len(ids)
    pool.settle()  # rows released by the garbage collector join the semantic index's queue first
    return [pool.reuse.embed(ids[b][real[b]]) if canonical[b] == b else None for b in range(len(ids))]


def inherit_rows(pool: KVPool, model: str, tenant: str, sequences: list[Sequence], ids: np.ndarray,
                 real: np.ndarray, canonical: np.ndarray, vectors: list) -> np.ndarray:
    """Attach each distinct row's longest reusable prefix to its (empty) sequence, under the
    pool's lock; returns per row how many of its leading real tokens are now stored. The last
    token of every row is always left to compute: its logits pick the next token."""
    inherited = np.zeros(len(ids), dtype=np.int64)
    for b, sequence in enumerate(sequences):
        if canonical[b] != b:
            continue
        tokens = ids[b][real[b]]
        blocks, length = pool.reuse.inherit(model, tenant, tokens, len(tokens) - 1,
                                            lambda digest, after: pool.promote(digest, model, after), vectors[b])
        sequence.blocks, sequence.length, sequence.tokens = blocks, length, tokens[:length].tolist()
        inherited[b] = length
    inherited[:] = inherited[canonical]
    return inherited


def share_duplicates(pool: KVPool, sequences: list[Sequence], canonical: np.ndarray) -> None:
    """Give every duplicate row its first twin's blocks (after the twin's blocks were allocated)."""
    for b, sequence in enumerate(sequences):
        if canonical[b] != b:
            twin = sequences[canonical[b]]
            sequence.blocks, sequence.length, sequence.tokens = list(twin.blocks), twin.length, list(twin.tokens)
            pool.incref(sequence.blocks)
