"""Preparing a `generate` forward: for a fresh batch, find identical prompts (stored once) and
attach each row's longest reusable prefix (exact block hashes, lower tiers, the semantic index);
then allocate the new tokens' blocks and plan the forward. Used by `PagedCache.begin_forward`.
"""

from __future__ import annotations

import numpy as np

from . import planner
from .errors import PagedKVError, PoolExhaustedError
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
    lengths = [s.length for s in sequences]
    inherited = np.zeros(batch, dtype=np.int64)
    with pool.locked():
        try:
            if reuse:
                inherited = inherit_rows(pool, *reuse, sequences, ids, real, canonical, vectors)
            writers = canonical == np.arange(batch)
            pool.grow(sequences, np.where(writers, real.sum(axis=1) - inherited, 0))
            if fresh:
                share_duplicates(pool, sequences, canonical)
            skip = planner.columns_to_skip(real, inherited) if may_skip else 0
            plan = planner.plan_batch(sequences, real, pool.block_size, inherited, writers, skip, logical)
            pool.mark_written(plan.slot_mapping)
        except BaseException:  # PoolExhaustedError, or an interruption: every block taken goes back
            for sequence, length in zip(sequences, lengths):
                pool.decref(sequence.truncate(length, pool.block_size) if not fresh else sequence.blocks)
            raise
    return sequences, plan, inherited


def shared_prefixes(pool: KVPool, model: str, tenant: str, ids: np.ndarray, real: np.ndarray) -> list[list[int]]:
    """The longest whole-block prefixes that several rows of a fresh batch share and the pool
    does not hold yet, each once (a prefix inside another chosen one is left out): computed
    first, they are then inherited by every row instead of being computed once per row."""
    check_mask(real.shape, *ids.shape)
    size, index = pool.block_size, pool.reuse.index
    # distinct prompts, each up to its first gap (a hole in its mask: see Sequence.shareable_length)
    rows = {tokens.tobytes(): tokens for tokens in (before_gap(ids[b], real[b]) for b in range(len(ids)))}.values()
    chains = [(tokens, index.chain(index.root(model, tenant), tokens[: (len(tokens) - 1) // size * size]))
              for tokens in rows]
    counts: dict[bytes, int] = {}
    for _, chain in chains:
        for digest in chain:
            counts[digest] = counts.get(digest, 0) + 1
    now, ends = pool.policy.now(), {}
    with pool.locked():  # another thread's eviction must not unindex a block between two looks
        for tokens, chain in chains:
            shared = [d for d, digest in enumerate(chain) if counts[digest] > 1]
            if shared and index.lookup(chain[shared[-1]], now) is None:
                ends[chain[shared[-1]]] = (tokens[: (shared[-1] + 1) * size], set(chain[: shared[-1]]))
    inner = set().union(*(inside for _, inside in ends.values())) if ends else set()
    return [tokens.tolist() for digest, (tokens, _) in ends.items() if digest not in inner]


def compute_prefixes(pool: KVPool, model: str, tenant: str, prefixes: list[list[int]], run) -> None:
    """Compute `prefixes` in one packed forward (`run(sequences, counts, ids)` runs it: `packed.run`) and
    leave their blocks cached for the rows that follow. A pool too full for them skips it."""
    sequences = [Sequence() for _ in prefixes]
    with pool.locked():
        for sequence, tokens in zip(sequences, prefixes):
            blocks, length = pool.reuse.inherit(model, tenant, np.asarray(tokens), len(tokens),
                                                lambda digest, after: pool.promote(digest, model, after))
            sequence.blocks, sequence.length, sequence.tokens = blocks, length, tokens[:length]
        counts = [len(t) - s.length for t, s in zip(prefixes, sequences)]
        try:
            pool.grow(sequences, counts)
        except PoolExhaustedError:
            counts = []
    try:
        if counts and sum(counts):
            # as int64 arrays: a prefix found whole (published, or in a lower tier) adds no ids, and an
            # empty list would make NumPy's concatenation float64
            run(sequences, counts, np.concatenate([np.asarray(t[s.length :], dtype=np.int64) for t, s in zip(prefixes, sequences)]))
            with pool.locked():
                for sequence, tokens in zip(sequences, prefixes):
                    sequence.tokens, sequence.length = list(tokens), len(tokens)
                    pool.reuse.index_sequence(model, tenant, sequence, 0)
    finally:
        with pool.locked():
            for sequence in sequences:
                pool.decref(sequence.blocks)


def stored_columns(attention_mask, batch: int, width: int) -> np.ndarray:
    """bool `[B, T]`: which of the forward's columns hold real tokens (stored), from the mask's tail."""
    if attention_mask is None:
        return np.ones((batch, width), dtype=bool)
    if attention_mask.dim() != 2:
        raise PagedKVError(
            f"PagedCache needs a 2D [batch, length] attention_mask (got {attention_mask.dim()}D): it reads padding from it"
        )
    check_mask(tuple(attention_mask.shape), batch, width)
    return attention_mask[:, -width:].detach().cpu().numpy().astype(bool)


def positions_counted(sequences: list[Sequence], real: np.ndarray, position_ids) -> np.ndarray:
    """Per row, whether the forward's tokens sit where `generate` puts them: each stored token at
    its rank among its row's stored tokens (`real`: the forward's stored columns `[B, T]`;
    `position_ids`: the caller's, or None where the model counts `past + column`). Only then is
    a block's KV what its hash – token ids alone – promises another request: a row that is not
    shares nothing of this forward (and a batch with one inherits nothing)."""
    batch, width = real.shape
    if sequences and len(sequences) != batch:
        return np.zeros(batch, dtype=bool)  # a changed batch, refused by begin_forward
    before = np.array([s.length for s in sequences] if sequences else [0] * batch)[:, None]
    rank = before + np.cumsum(real, axis=1) - 1
    if position_ids is None:  # column counting equals the rank only where no pad ever came
        unpadded = np.array([s.length == s.logical_length for s in sequences] or [True] * batch)
        return real.all(axis=1) & unpadded
    if position_ids.dim() != 2 or position_ids.shape[1] != width or position_ids.shape[0] not in (1, batch):
        return np.zeros(batch, dtype=bool)  # multi-axis positions (M-RoPE) and the like: not generate's count
    given = np.broadcast_to(position_ids.detach().cpu().numpy(), (batch, width))
    return ((given == rank) | ~real).all(axis=1)


def check_mask(shape: tuple[int, ...], batch: int, width: int) -> None:
    """An attention mask must give every input row its padding, for at least the forward's columns."""
    if shape[0] != batch or shape[1] < width:
        raise PagedKVError(f"the attention_mask {tuple(shape)} does not cover the forward's {batch} rows of {width} "
                           "tokens: it needs one row per input row and at least as many columns")


def duplicate_rows(ids: np.ndarray, real: np.ndarray) -> np.ndarray:
    """For each row, the first row with the same tokens and padding (itself if none)."""
    first: dict[bytes, int] = {}
    return np.array([first.setdefault(ids[b].tobytes() + real[b].tobytes(), b) for b in range(len(ids))])


def prompt_vectors(pool: KVPool, ids: np.ndarray, real: np.ndarray, canonical: np.ndarray) -> list:
    """Each distinct prompt's sentence embedding for the semantic index (None without one).
    Runs before the pool's lock is taken: embedding is slow."""
    if pool.semantic is None:
        return [None] * len(ids)
    with pool.locked():  # runs queued finalizer work: rows the garbage collector released join the queue first
        pass
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
        limit = min(len(tokens) - 1, len(before_gap(ids[b], real[b])))  # nothing past a hole is shared
        blocks, length = pool.reuse.inherit(model, tenant, tokens, limit,
                                            lambda digest, after: pool.promote(digest, model, after), vectors[b])
        sequence.blocks, sequence.length, sequence.tokens = blocks, length, tokens[:length].tolist()
        inherited[b] = length
    inherited[:] = inherited[canonical]
    return inherited


def before_gap(ids: np.ndarray, real: np.ndarray) -> np.ndarray:
    """The row's stored tokens before the first pad that follows one (all of them without)."""
    first = int(real.argmax()) if real.any() else len(real)
    gaps = np.flatnonzero(~real[first:])
    return ids[first : first + int(gaps[0])] if len(gaps) else ids[real]


def share_duplicates(pool: KVPool, sequences: list[Sequence], canonical: np.ndarray) -> None:
    """Give every duplicate row its first twin's blocks (after the twin's blocks were allocated)."""
    for b, sequence in enumerate(sequences):
        if canonical[b] != b:
            twin = sequences[canonical[b]]
            sequence.blocks, sequence.length, sequence.tokens = list(twin.blocks), twin.length, list(twin.tokens)
            pool.incref(sequence.blocks)
