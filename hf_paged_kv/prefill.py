"""Preparing the rows of a fresh batch before its first forward: find identical prompts (stored
once), and attach each row's longest reusable prefix (exact block hashes, lower tiers, the
semantic index). Used by `PagedCache.begin_forward`; the serving engine does the same per request.
"""

from __future__ import annotations

import numpy as np

from .pool import KVPool
from .sequence import Sequence


def duplicate_rows(ids: np.ndarray, real: np.ndarray) -> np.ndarray:
    """For each row, the first row with the same tokens and padding (itself if none)."""
    first: dict[bytes, int] = {}
    return np.array([first.setdefault(ids[b].tobytes() + real[b].tobytes(), b) for b in range(len(ids))])


def prompt_vectors(pool: KVPool, ids: np.ndarray, real: np.ndarray, canonical: np.ndarray) -> list:
    """Each distinct prompt's sentence embedding for the semantic index (None without one).
    Runs before the pool's lock is taken: embedding is slow."""
    if pool.semantic is None:
        return [None] * len(ids)
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
                                            lambda digest: pool.promote(digest, model), vectors[b])
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
