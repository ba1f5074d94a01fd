"""The planner of a `generate` forward: the one place that decides, for one forward on a
PagedCache, which columns are stored, what each row inherits, which columns the model may skip
and where each token's K/V goes. The forward wrapper (`integration`) calls it and applies the
plan; the cache keeps the planned rows until the forward commits or is undone:

    plan = forward_plan.plan(cache, pool, kwargs, context)     # kwargs: the model's arguments
    with step.activate(plan.step, backend, plan.need_weights):
        output = model_forward(**plan.inputs(kwargs))          # the columns it skips dropped
    cache.finish_forward()                                     # any exception: cache.abort_forward()

One forward, in order (`plan`):

1. rows whose stored tokens a later turn's mask hides drop them (`history.follow_mask`);
2. the stored columns: the mask's tail (pads are never stored); and per row whether its
   positions are the ones `generate` gives, the only K/V a block hash (token ids) may name;
3. a fresh batch whose rows share an uncached prefix computes it once first, in a packed
   forward of its own (`packed.run`), which every row then inherits;
4. the rows (`plan_rows`): identical prompts stored once, each distinct prompt's longest
   reusable prefix inherited (block hashes, lower tiers, the semantic index), blocks for the
   rest allocated, all or nothing;
5. the `StepPlan` (`planner.plan_batch`: slots, block tables, positions each query sees) with
   the leading columns no row computes, and the cache adopting the rows (`PagedCache.adopt`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import PagedKVError, PoolExhaustedError
from ..pool import KVPool
from . import history, packed, planner
from .sequence import Sequence
from .step import StepPlan

_PER_TOKEN_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids")


@dataclass(frozen=True)
class Context:
    """What the integration tells the planner of the model and of the `generate` call."""

    forward: Callable  # the model's own forward: the shared-prefix pre-pass runs it
    backend: object  # the attention backend it runs on
    fingerprint: str  # of the weights (`integration.current_fingerprint`): part of every block hash
    new_turn: bool  # the forward begins a turn of the conversation (`pin_turns` counts them)
    mask_extends: bool  # a later forward of one generate call: its mask only appends columns
    reproducible: bool  # another forward of the same tokens computes the same K/V (False in train mode)
    rope_limit: int | None  # positions a forward may span with fixed RoPE (model_checks.rope_length_limit)
    output_attentions: bool  # the config's default for the forward's `output_attentions`


@dataclass
class ForwardPlan:
    """One planned forward: its rows (blocks allocated, inherited prefixes attached), the
    StepPlan its attention layers follow, and what the cache commits after it or gives back."""

    step: StepPlan
    sequences: list[Sequence]  # the rows the cache holds for the forward
    real: np.ndarray  # [B, T] stored columns
    ids: np.ndarray  # [B, T] token ids (-1 where unknown or not to be matched: see Sequence.tokens)
    inherited: np.ndarray  # per row: leading real tokens already stored (a reused prefix)
    lengths_before: list[int]  # stored lengths before it (a fresh cache: none)
    new_turn: bool  # it begins a turn of the conversation (`pin_turns` counts them)
    need_weights: bool  # the caller wants attention weights (spread over logical positions)

    def inputs(self, kwargs: dict) -> dict:
        """The forward's arguments without the leading columns every row has stored or padded
        (`step.skip`; prefix reuse). The caller's positions are cut the same way, so RoPE and
        learned position embeddings see the truth."""
        skip = self.step.skip
        if not skip:
            return kwargs
        kwargs = dict(kwargs)
        kwargs["position_ids"] = kwargs["position_ids"][..., skip:]
        if kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = kwargs["attention_mask"][:, skip:]
        for name in ("input_ids", "inputs_embeds"):
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][:, skip:]
        return kwargs

    def commit(self, sequences: list[Sequence]) -> None:
        """Append to each row the tokens this forward stored after its inherited prefix."""
        for b, sequence in enumerate(sequences):
            sequence.append(self.real[b], self.ids[b][self.real[b]][self.inherited[b] :])

    def undo(self, pool: KVPool, sequences: list[Sequence]) -> list[Sequence]:
        """Give back what planning took; returns the rows as they were before the forward (none
        when it began the cache)."""
        with pool.locked():
            if not self.lengths_before:
                for sequence in sequences:
                    pool.decref(sequence.blocks)
                return []
            for sequence, length in zip(sequences, self.lengths_before):
                pool.decref(sequence.truncate(length, pool.block_size))
        return sequences


def input_shape(kwargs: dict) -> tuple[int, int]:
    """`(batch, width)` of the forward's `input_ids` or `inputs_embeds`."""
    inputs = kwargs.get("input_ids")
    inputs = inputs if inputs is not None else kwargs.get("inputs_embeds")
    if inputs is None:
        raise PagedKVError("forward needs input_ids or inputs_embeds")
    return tuple(inputs.shape[:2])


def plan(cache, pool: KVPool, kwargs: dict, context: Context) -> ForwardPlan:
    """Plan the forward of `kwargs` (the model's arguments by name) on `cache`, a PagedCache this
    thread has claimed, and have the cache adopt its rows. Raises PoolExhaustedError (or any
    refusal) before the rows change, except for the tokens a later turn's mask hides."""
    input_ids, mask, positions = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("position_ids")
    batch, width = input_shape(kwargs)
    # a later turn may mask what an earlier one stored: those rows drop it first (generate's own
    # decode steps only append to the mask: not copied to the host for each token); a cache of
    # another pool is refused by plan_rows
    if cache.is_initialized and cache.pool is pool and not context.mask_extends:
        history.follow_mask(pool, cache.sequences, mask, width)
    # KV at other positions than generate's must not be shared: hashes say token ids only
    stored = _stored_columns(mask, batch, width)  # read once: a copy from the device
    counted = _positions_counted(cache.sequences, stored, positions)
    # nor K/V that another forward of the same tokens would not compute: dropout in train mode,
    # or RoPE frequencies chosen by this forward's length (model_checks.rope_length_limit)
    if not context.reproducible or _rope_scaled(context.rope_limit, cache, positions, width):
        counted[:] = False
    extras = _per_token_extras(kwargs)
    may_skip = bool(counted.all()) and _may_skip(kwargs, extras)
    if may_skip and not cache.is_initialized and cache.reuse and input_ids is not None and batch > 1:
        _compute_shared_prefixes(context, pool, cache.tenant, input_ids, mask)
    need_weights = kwargs.get("output_attentions")
    need_weights = bool(context.output_attentions if need_weights is None else need_weights)
    # per-token inputs besides the ids (token_type_ids, ...) shape the K/V as well, as other
    # positions do: the rows are then told no ids, as with inputs_embeds, so no rows are merged and
    # nothing is indexed or inherited by ids (equal ids with other token types gave another row's tokens)
    known_ids = None if extras or input_ids is None else _unknown_where(input_ids, ~counted)
    return plan_rows(cache, pool, context.fingerprint, known_ids, stored, (batch, width), may_skip, need_weights,
                     context.new_turn)


def plan_rows(cache, pool: KVPool, model: str, input_ids, stored: np.ndarray | None, shape: tuple[int, int],
              allow_reuse: bool, logical: bool = False, new_turn: bool | None = None) -> ForwardPlan:
    """Plan the rows of a forward whose inputs are read already (`plan`; no model needed) and
    have the claimed `cache` adopt them.

    `model`: the fingerprint of the weights computing it; `input_ids`: the ids to store and match
    (None: unknown, nothing shared); `stored`: the columns holding tokens `[B, T]` (None: all);
    `allow_reuse`: only the last position's logits are needed, as in generate, so the forward may
    inherit cached prefixes and skip their columns; `logical`: give logical positions (attention
    weights); `new_turn`: it begins a turn (by default when it feeds more than one token)."""
    real = np.ones(shape, dtype=bool) if stored is None else stored
    ids = input_ids.detach().cpu().numpy() if input_ids is not None else np.full(real.shape, -1)
    cache.bind(pool, model)
    fresh, before = not cache.sequences, [s.length for s in cache.sequences]
    if not fresh and len(cache.sequences) != len(real):
        raise PagedKVError(f"batch size changed from {len(cache.sequences)} to {len(real)} rows within one "
                           "PagedCache; use a fresh PagedCache for a new batch")
    reuse = (model, cache.tenant) if fresh and allow_reuse and cache.reuse and input_ids is not None else None
    # planning runs outside the pool's lock where it can (the semantic index embeds text)
    sequences, step_plan, inherited = _allocate_rows(pool, None if fresh else cache.sequences, ids, real, reuse,
                                                     allow_reuse, logical)
    planned = ForwardPlan(step_plan, sequences, real, ids, inherited, before,
                          real.shape[1] > 1 if new_turn is None else new_turn, logical)
    cache.adopt(planned)
    return planned


def _allocate_rows(pool: KVPool, sequences: list[Sequence] | None, ids: np.ndarray, real: np.ndarray,
                   reuse: tuple[str, str] | None, may_skip: bool,
                   logical: bool) -> tuple[list[Sequence], StepPlan, np.ndarray]:
    """Give `sequences` (None: a fresh batch) the blocks for the forward's tokens and plan the
    forward's slots. `reuse`: `(model fingerprint, tenant)` to inherit cached prefixes (a fresh
    batch only). All or nothing: any exception (PoolExhaustedError, an interruption) leaves the
    pool and the sequences as they were. Returns the sequences, the plan and per row the tokens
    inherited."""
    batch = len(real)
    fresh = sequences is None
    canonical = _duplicate_rows(ids, real) if fresh and (ids >= 0).all() else np.arange(batch)
    vectors = _prompt_vectors(pool, ids, real, canonical) if reuse else None
    sequences = [Sequence() for _ in range(batch)] if fresh else sequences
    lengths = [s.length for s in sequences]
    inherited = np.zeros(batch, dtype=np.int64)
    with pool.locked():
        try:
            if reuse:
                inherited = _inherit_rows(pool, *reuse, sequences, ids, real, canonical, vectors)
            writers = canonical == np.arange(batch)
            pool.grow(sequences, np.where(writers, real.sum(axis=1) - inherited, 0))
            if fresh:
                _share_duplicates(pool, sequences, canonical)
            skip = planner.columns_to_skip(real, inherited) if may_skip else 0
            step_plan = planner.plan_batch(sequences, real, pool.block_size, inherited, writers, skip, logical)
            pool.mark_written(step_plan.slot_mapping)
        except BaseException:  # every block taken goes back
            for sequence, length in zip(sequences, lengths):
                pool.decref(sequence.truncate(length, pool.block_size) if not fresh else sequence.blocks)
            raise
    return sequences, step_plan, inherited


# ------------------------------------------------------------ reading the inputs
def _stored_columns(attention_mask, batch: int, width: int) -> np.ndarray:
    """bool `[B, T]`: which of the forward's columns hold real tokens (stored), from the mask's tail."""
    if attention_mask is None:
        return np.ones((batch, width), dtype=bool)
    if attention_mask.dim() != 2:
        raise PagedKVError(
            f"PagedCache needs a 2D [batch, length] attention_mask (got {attention_mask.dim()}D): it reads padding from it"
        )
    _check_mask(tuple(attention_mask.shape), batch, width)
    return attention_mask[:, -width:].detach().cpu().numpy().astype(bool)


def _check_mask(shape: tuple[int, ...], batch: int, width: int) -> None:
    """An attention mask must give every input row its padding, for at least the forward's columns."""
    if shape[0] != batch or shape[1] < width:
        raise PagedKVError(f"the attention_mask {tuple(shape)} does not cover the forward's {batch} rows of {width} "
                           "tokens: it needs one row per input row and at least as many columns")


def _positions_counted(sequences: list[Sequence], real: np.ndarray, position_ids) -> np.ndarray:
    """Per row, whether the forward's tokens sit where `generate` puts them: each stored token at
    its rank among its row's stored tokens (`real`: the forward's stored columns `[B, T]`;
    `position_ids`: the caller's, or None where the model counts `past + column`). Only then is
    a block's KV what its hash – token ids alone – promises another request: a row that is not
    shares nothing of this forward (and a batch with one inherits nothing)."""
    batch, width = real.shape
    if sequences and len(sequences) != batch:
        return np.zeros(batch, dtype=bool)  # a changed batch, refused by plan_rows
    before = np.array([s.length for s in sequences] if sequences else [0] * batch)[:, None]
    rank = before + np.cumsum(real, axis=1) - 1
    if position_ids is None:  # column counting equals the rank only where no pad ever came
        unpadded = np.array([s.length == s.logical_length for s in sequences] or [True] * batch)
        return real.all(axis=1) & unpadded
    if position_ids.dim() != 2 or position_ids.shape[1] != width or position_ids.shape[0] not in (1, batch):
        return np.zeros(batch, dtype=bool)  # multi-axis positions (M-RoPE) and the like: not generate's count
    given = np.broadcast_to(position_ids.detach().cpu().numpy(), (batch, width))
    return ((given == rank) | ~real).all(axis=1)


def _rope_scaled(limit: int | None, cache, position_ids, width: int) -> bool:
    """Whether the forward spans `limit` positions or more, past which transformers picks
    length-dependent RoPE frequencies by its largest position (None: the model's never change)."""
    if limit is None:
        return False
    last = int(position_ids.max()) if position_ids is not None else cache.get_seq_length() + width - 1
    return last + 1 >= limit


def _per_token_extras(kwargs) -> list[str]:
    """Names of the per-token tensors (two dimensions or more) the forward gets besides its ids,
    embeddings, mask, positions and cache."""
    return [k for k, v in kwargs.items() if torch.is_tensor(v) and v.dim() >= 2 and k not in _PER_TOKEN_INPUTS
            and k != "past_key_values"]


def _may_skip(kwargs, extras: list[str]) -> bool:
    """Whether the forward may drop leading columns a row has cached: only when just the last
    position's logits are returned (generate) and nothing else per position is, and the caller
    gives the positions: a model that derives them itself may derive them from the pad tokens
    (Kosmos-2 counts non-pad ids), which a shortened forward would no longer see."""
    if kwargs.get("position_ids") is None:
        return False
    if kwargs.get("logits_to_keep") != 1 or kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return False
    return not extras


def _unknown_where(input_ids, rows: np.ndarray):
    """`input_ids` with the ids of `rows` replaced by -1 (their KV must not be found by them)."""
    if not rows.any():
        return input_ids
    return input_ids.masked_fill(torch.as_tensor(rows, device=input_ids.device)[:, None], -1)


# ------------------------------------------------------ the shared-prefix pre-pass
def _compute_shared_prefixes(context: Context, pool: KVPool, tenant: str, input_ids, attention_mask) -> None:
    """A fresh batch whose rows share an uncached prefix computes it once, in a packed forward
    of its own, and leaves its blocks cached: the batch's forward then inherits it in every row
    instead of computing it once per row. A pool too full for it skips it."""
    model = context.fingerprint
    ids = input_ids.detach().cpu().numpy()
    real = (attention_mask.detach().cpu().numpy().astype(bool) if attention_mask is not None
            else np.ones(ids.shape, dtype=bool))
    prefixes = _shared_prefixes(pool, model, tenant, ids, real)
    if not prefixes:
        return
    sequences = [Sequence() for _ in prefixes]
    with pool.locked():
        for sequence, tokens in zip(sequences, prefixes):
            blocks, length = pool.inherit(model, tenant, tokens, len(tokens))
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
            new = np.concatenate([np.asarray(t[s.length :], dtype=np.int64) for t, s in zip(prefixes, sequences)])
            with torch.no_grad():  # only the K/V it stores is wanted
                packed.run(context.forward, context.backend, pool, sequences, counts, new, input_ids.device,
                           logits_to_keep=1)
            with pool.locked():
                for sequence, tokens in zip(sequences, prefixes):
                    sequence.tokens, sequence.length = list(tokens), len(tokens)
                    pool.publish_blocks(model, tenant, sequence, 0)
    finally:
        with pool.locked():
            for sequence in sequences:
                pool.decref(sequence.blocks)


def _shared_prefixes(pool: KVPool, model: str, tenant: str, ids: np.ndarray, real: np.ndarray) -> list[list[int]]:
    """The longest whole-block prefixes that several rows of a fresh batch share and the pool
    does not hold yet, each once (a prefix inside another chosen one is left out)."""
    _check_mask(real.shape, *ids.shape)
    size = pool.block_size
    # distinct prompts, each up to its first gap (a hole in its mask: see Sequence.shareable_length)
    rows = {tokens.tobytes(): tokens for tokens in (_before_gap(ids[b], real[b]) for b in range(len(ids)))}.values()
    chains = [(tokens, [own for own, _ in pool.digest_pairs(model, tenant, tokens, (len(tokens) - 1) // size)])
              for tokens in rows]
    counts: dict[bytes, int] = {}
    for _, chain in chains:
        for digest in chain:
            counts[digest] = counts.get(digest, 0) + 1
    ends = {}
    with pool.locked():  # another thread's eviction must not unindex a block between two looks
        for tokens, chain in chains:
            shared = [d for d, digest in enumerate(chain) if counts[digest] > 1]
            if shared and not pool.is_cached(chain[shared[-1]]):
                ends[chain[shared[-1]]] = (tokens[: (shared[-1] + 1) * size], set(chain[: shared[-1]]))
    inner = set().union(*(inside for _, inside in ends.values())) if ends else set()
    return [tokens.tolist() for digest, (tokens, _) in ends.items() if digest not in inner]


# ---------------------------------------------------------------- the rows
def _duplicate_rows(ids: np.ndarray, real: np.ndarray) -> np.ndarray:
    """For each row, the first row with the same tokens and padding (itself if none)."""
    first: dict[bytes, int] = {}
    return np.array([first.setdefault(ids[b].tobytes() + real[b].tobytes(), b) for b in range(len(ids))])


def _prompt_vectors(pool: KVPool, ids: np.ndarray, real: np.ndarray, canonical: np.ndarray) -> list:
    """Each distinct prompt's sentence embedding for the semantic index (None without one).
    Runs before the pool's lock is taken: embedding is slow."""
    if pool.semantic is None:
        return [None] * len(ids)
    with pool.locked():  # runs queued finalizer work: rows the garbage collector released join the queue first
        pass
    return [pool.embed(ids[b][real[b]]) if canonical[b] == b else None for b in range(len(ids))]


def _inherit_rows(pool: KVPool, model: str, tenant: str, sequences: list[Sequence], ids: np.ndarray,
                  real: np.ndarray, canonical: np.ndarray, vectors: list) -> np.ndarray:
    """Attach each distinct row's longest reusable prefix to its (empty) sequence, under the
    pool's lock; returns per row how many of its leading real tokens are now stored. The last
    token of every row is always left to compute: its logits pick the next token."""
    inherited = np.zeros(len(ids), dtype=np.int64)
    for b, sequence in enumerate(sequences):
        if canonical[b] != b:
            continue
        tokens = ids[b][real[b]]
        limit = min(len(tokens) - 1, len(_before_gap(ids[b], real[b])))  # nothing past a hole is shared
        blocks, length = pool.inherit(model, tenant, tokens, limit, vectors[b])
        sequence.blocks, sequence.length, sequence.tokens = blocks, length, tokens[:length].tolist()
        inherited[b] = length
    inherited[:] = inherited[canonical]
    return inherited


def _before_gap(ids: np.ndarray, real: np.ndarray) -> np.ndarray:
    """The row's stored tokens before the first pad that follows one (all of them without)."""
    first = int(real.argmax()) if real.any() else len(real)
    gaps = np.flatnonzero(~real[first:])
    return ids[first : first + int(gaps[0])] if len(gaps) else ids[real]


def _share_duplicates(pool: KVPool, sequences: list[Sequence], canonical: np.ndarray) -> None:
    """Give every duplicate row its first twin's blocks (after the twin's blocks were allocated)."""
    for b, sequence in enumerate(sequences):
        if canonical[b] != b:
            twin = sequences[canonical[b]]
            sequence.blocks, sequence.length, sequence.tokens = list(twin.blocks), twin.length, list(twin.tokens)
            pool.incref(sequence.blocks)
