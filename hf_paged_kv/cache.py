"""PagedCache: a `transformers.Cache` whose KV lives in the blocks of a shared KVPool.

    >>> hf_paged_kv.enable(model)
    >>> with PagedCache() as cache:                    # binds to the model's pool on first use
    ...     out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
    ...     # multi-turn: pass the same cache with the whole conversation; only new tokens prefill
    ...     out = model.generate(**next_turn, past_key_values=cache, max_new_tokens=32)
    # leaving the block (or `cache.release()`, or garbage collection) frees the blocks

Each batch row is a `Sequence`: a block table and the tokens stored in it. Pad positions are
never stored; transformers still sees the logical (padded) length through `get_seq_length()`,
as with `DynamicCache`. Rows may share blocks (reference counted): identical prompts in one
batch are stored once, beam search reorders rows by sharing, `copy.deepcopy` shares everything,
and a row about to write into a shared block copies it first (copy-on-write).

The integration calls `begin_forward` before each forward (plan it: inherit cached prefixes,
allocate, compute slots) and then `finish_forward` or, if the forward raised anything at all,
`abort_forward`, which leaves the cache exactly as it was.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache

from . import planner, prefill, step
from .errors import CacheReleasedError, NotEnabledError, PagedKVError, PoolExhaustedError
from .pool import KVPool
from .reuse.prefix_index import PUBLIC_TENANT
from .sequence import Sequence


@dataclass
class _Forward:
    """A planned forward, committed by `finish_forward` or undone by `abort_forward`."""

    real: np.ndarray  # [B, T] stored columns
    ids: np.ndarray  # [B, T] token ids (-1 where only embeddings were given)
    inherited: np.ndarray  # per row: leading real tokens already stored (a reused prefix)
    lengths_before: list[int]  # stored lengths before this forward (a fresh cache: none)


class PagedCache(Cache):
    """Paged KV cache for `model.generate(past_key_values=PagedCache())` on an enabled model.

    Args:
        pool: the KVPool to draw blocks from. Default: the pool of the model the cache is first
            used with (`hf_paged_kv.enable(model)` creates it).
        tenant: whose KV this is. Cached prefixes are shared only within a tenant (and with
            prefixes published to all by `hf_paged_kv.publish`).
        reuse: inherit cached prefixes of earlier requests and offer this one's blocks to later
            ones (default). `False` computes everything and shares nothing.
        pin_turns: pin the first N turns of this conversation (a turn is a prefill of more
            than one token, i.e. one `generate` call) in device memory, within the pool's pin
            budget; see `hf_paged_kv.reuse.pins`.
        priority: weight of this request's cached blocks in eviction and demotion (each step
            doubles their value; see `hf_paged_kv.policy`).
    """

    is_compileable = False  # True would switch on transformers' auto-compile for custom caches

    def __init__(self, pool: KVPool | None = None, tenant: str = "default", reuse: bool = True, pin_turns: int = 0,
                 priority: int = 0):
        super().__init__(layers=[])
        if not isinstance(tenant, str) or not tenant or tenant == PUBLIC_TENANT:
            raise ValueError(f"tenant must be a non-empty string other than {PUBLIC_TENANT!r}, got {tenant!r}")
        if pin_turns < 0 or (pin_turns and not reuse):
            raise ValueError("pin_turns must be >= 0, and pinned turns are only useful with reuse=True")
        self.tenant, self.reuse, self.pin_turns, self.priority = tenant, reuse, pin_turns, priority
        self.sequences: list[Sequence] = []
        self.inherited: list[int] = []  # per row: prompt tokens inherited from cached prefixes
        self._pool = pool
        self._model: str | None = None  # fingerprint of the weights that computed this cache's KV
        self._forward: _Forward | None = None
        self._turn_starts: list[list[int]] = []  # stored row lengths when each turn began
        self._turns_pinned = False
        self._released = False

    # ------------------------------------------------------------- lifecycle
    @property
    def pool(self) -> KVPool | None:
        """The pool this cache draws from (None until first used with an enabled model)."""
        return self._pool

    def release(self) -> None:
        """Free every block this cache holds. Using the cache afterwards raises CacheReleasedError."""
        if self._released:
            return
        if self._forward is not None:
            self.abort_forward()
        if self._pool is not None and self.sequences:
            with self._pool.locked():
                self._release_rows(self._pool, self.sequences, offer=True)
        self.sequences, self._released = [], True

    def _release_rows(self, pool: KVPool, sequences: list[Sequence], offer: bool) -> None:
        shareable = offer and self.reuse and self._model is not None
        if shareable and self.pin_turns and self._turn_starts and not self._turns_pinned:
            self._pin_turns([s.length for s in sequences])
        for sequence in sequences:
            if shareable:
                pool.reuse.offer(self._model, self.tenant, sequence)
            pool.decref(sequence.blocks)

    def __enter__(self) -> "PagedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        # A finalizer may run inside any pool operation: it queues the release, never locks.
        if not getattr(self, "_released", True) and self._pool is not None and self.sequences:
            offer = self._forward is None
            self._pool.defer(functools.partial(self._release_rows, self._pool, self.sequences, offer))
            self._released = True

    def __deepcopy__(self, memo) -> "PagedCache":
        """A copy that shares every block (copy-on-write) and continues independently."""
        self._check_alive()
        twin = PagedCache(self._pool, reuse=self.reuse, pin_turns=self.pin_turns, priority=self.priority)
        twin.tenant, twin._model, twin.inherited = self.tenant, self._model, list(self.inherited)
        twin._turn_starts, twin._turns_pinned = [list(t) for t in self._turn_starts], self._turns_pinned
        twin.sequences = [s.copy() for s in self.sequences]
        if self._pool is not None:
            with self._pool.locked():
                for sequence in twin.sequences:
                    self._pool.incref(sequence.blocks)
        return twin

    def _check_alive(self) -> None:
        if self._released:
            raise CacheReleasedError("this PagedCache was released; create a new PagedCache()")

    # --------------------------------------------------- transformers protocol
    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._check_alive()
        return self.sequences[0].logical_length if self.sequences else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def __len__(self) -> int:
        return len(self._pool.layers) if self._pool is not None and self._pool.is_bound else 0

    @property
    def batch_size(self) -> int:
        return len(self.sequences) if self.sequences else -1

    @property
    def is_initialized(self) -> bool:
        return bool(self.sequences)

    @property
    def is_croppable(self) -> bool:
        return True

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Returns the new K/V unchanged: the registered attention function writes them into
        their blocks and reads the whole sequence from the pool."""
        self._check_alive()
        if step.current() is None:
            raise NotEnabledError(
                "PagedCache needs its model prepared by `hf_paged_kv.enable(model)` before generate/forward"
            )
        return key_states, value_states

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row `beam_idx[i]`, sharing its blocks."""
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([r for r in range(len(self.sequences)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices.tolist())

    def _select_rows(self, rows: list[int]) -> None:
        self._check_alive()
        if not self.sequences:
            return
        chosen = [self.sequences[r].copy() for r in rows]
        with self._pool.locked():
            for sequence in chosen:
                self._pool.incref(sequence.blocks)
            for sequence in self.sequences:
                self._pool.decref(sequence.blocks)
        self.sequences = chosen
        self.inherited = [self.inherited[r] for r in rows] if self.inherited else []

    def crop(self, max_length: int) -> None:
        """Drop the last `-max_length` logical positions if negative (what generate does); keep
        the first `max_length` if positive; 0 changes nothing (transformers' convention)."""
        self._check_alive()
        logical = self.get_seq_length()
        keep = max_length if max_length > 0 else logical + max_length
        if keep >= logical or not self.sequences:
            return
        with self._pool.locked():
            for sequence in self.sequences:
                self._pool.decref(sequence.crop(max(keep, 0), self._pool.block_size))

    def reset(self) -> None:
        """Forget all tokens and free the blocks; the cache stays usable."""
        self._check_alive()
        if self._pool is not None and self.sequences:
            with self._pool.locked():
                for sequence in self.sequences:
                    self._pool.decref(sequence.blocks)
        self.sequences, self.inherited = [], []

    # ------------------------------------------------------ forward lifecycle
    def begin_forward(self, pool: KVPool, model: str, input_ids, attention_mask, shape: tuple[int, int],
                      allow_reuse: bool, logical: bool = False) -> step.StepPlan:
        """Plan the forward about to run (called by the model's forward wrapper).

        Binds the cache to `pool`; a fresh cache with `allow_reuse` (the caller needs only the
        last position's logits, as `generate` does) inherits each row's longest cached prefix,
        and the plan's `skip` says how many leading input columns the forward may drop.
        Raises PoolExhaustedError before changing anything when the pool cannot hold the new
        tokens. `model` is the fingerprint of the weights about to run; `logical` asks the plan
        for logical key positions (to report attention weights).
        """
        self._check_alive()
        if self._forward is not None:  # the previous forward never finished (interrupted)
            self.abort_forward()
        self._bind(pool, model)
        batch, width = shape
        real = _stored_columns(attention_mask, batch, width)
        ids = input_ids.detach().cpu().numpy() if input_ids is not None else np.full((batch, width), -1)
        fresh = not self.sequences
        if not fresh and len(self.sequences) != batch:
            raise PagedKVError(f"batch size changed from {len(self.sequences)} to {batch} rows within one "
                               "PagedCache; use a fresh PagedCache for a new batch")
        reusing = fresh and allow_reuse and self.reuse and input_ids is not None and self._model == model
        canonical = prefill.duplicate_rows(ids, real) if fresh and input_ids is not None else np.arange(batch)
        vectors = prefill.prompt_vectors(pool, ids, real, canonical) if reusing else None
        sequences = [Sequence() for _ in range(batch)] if fresh else self.sequences
        inherited = np.zeros(batch, dtype=np.int64)
        with pool.locked():
            if reusing:
                inherited = prefill.inherit_rows(pool, model, self.tenant, sequences, ids, real, canonical, vectors)
            writers = canonical == np.arange(batch)
            counts = np.where(writers, real.sum(axis=1) - inherited, 0)
            try:
                pool.grow(sequences, counts)
            except PoolExhaustedError:
                if fresh:
                    for sequence in sequences:
                        pool.decref(sequence.blocks)
                raise
            if fresh:
                prefill.share_duplicates(pool, sequences, canonical)
            skip = planner.columns_to_skip(real, inherited) if allow_reuse else 0
            plan = planner.plan_batch(sequences, real, pool.block_size, inherited, writers, skip, logical)
            pool.mark_written(plan.slot_mapping)
        before = [] if fresh else [s.length for s in sequences]
        self.sequences, self._forward = sequences, _Forward(real, ids, inherited, before)
        if fresh:
            self.inherited = inherited.tolist()
        return plan

    def finish_forward(self) -> None:
        """The forward succeeded: adopt its tokens, and offer the rows' new full blocks for reuse
        (identical blocks already indexed are shared instead)."""
        forward, self._forward = self._forward, None
        if forward is None:
            return
        width = forward.real.shape[1]
        if width > 1 and self.pin_turns:
            self._turn_starts.append(forward.lengths_before or [0] * len(self.sequences))
        for b, sequence in enumerate(self.sequences):
            stored = forward.ids[b][forward.real[b]][forward.inherited[b] :]
            sequence.history.extend(forward.real[b].astype(np.uint8).tobytes())
            sequence.tokens.extend(stored.tolist())
            sequence.length += len(stored)
        if self.reuse and self._model is not None:
            with self._pool.locked():
                for sequence in self.sequences:
                    self._pool.reuse.index_sequence(self._model, self.tenant, sequence, self.priority)
                if len(self._turn_starts) == self.pin_turns + 1 and not self._turns_pinned:
                    self._pin_turns(self._turn_starts[-1])

    def abort_forward(self) -> None:
        """The forward raised (any exception, KeyboardInterrupt included): undo its planning.
        Nothing it half-wrote is ever indexed, offered, pinned or read again."""
        forward, self._forward = self._forward, None
        if forward is None:
            return
        with self._pool.locked():
            if not forward.lengths_before:  # a fresh cache: give everything back
                for sequence in self.sequences:
                    self._pool.decref(sequence.blocks)
                self.sequences, self.inherited = [], []
                return
            for sequence, length in zip(self.sequences, forward.lengths_before):
                self._pool.decref(sequence.truncate(length, self._pool.block_size))

    def _bind(self, pool: KVPool, model: str) -> None:
        if self._pool is None:
            self._pool = pool
        elif self._pool is not pool:
            raise PagedKVError("this PagedCache holds blocks of another model's pool; use a fresh PagedCache per model")
        if self._model is None and not self.sequences:
            self._model = model
        elif self._model != model:  # other weights now: keep computing, never share what this cache holds
            self._model = None

    def _pin_turns(self, lengths: list[int]) -> None:
        """Pin each row's full blocks before `lengths` (the end of the first pin_turns turns)."""
        size = self._pool.block_size
        for sequence, length in zip(self.sequences, lengths):
            if length >= size:
                self._pool.reuse.pins.add(sequence.blocks[: length // size], self.tenant, 0, None, "turns")
        self._turns_pinned = True

    # ---------------------------------------------------------- inspection
    def row_lengths(self) -> list[int]:
        """Stored (non-pad) tokens per row."""
        return [s.length for s in self.sequences]

    def block_tables(self) -> list[list[int]]:
        return [list(s.blocks) for s in self.sequences]

    def token_ids(self) -> list[list[int]]:
        """Token ids of the stored tokens of each row (-1 where the forward had only embeddings)."""
        return [list(s.tokens) for s in self.sequences]

    def __repr__(self) -> str:
        state = "released" if self._released else f"rows={len(self.sequences)}, seq_len={self.get_seq_length()}"
        return f"PagedCache({state}, blocks={sum(len(s.blocks) for s in self.sequences)})"


def _stored_columns(attention_mask, batch: int, width: int) -> np.ndarray:
    """bool `[B, T]`: which of the forward's columns hold real tokens (stored), from the mask's tail."""
    if attention_mask is None:
        return np.ones((batch, width), dtype=bool)
    if attention_mask.dim() != 2:
        raise PagedKVError(
            f"PagedCache needs a 2D [batch, length] attention_mask (got {attention_mask.dim()}D): it reads padding from it"
        )
    return attention_mask[:, -width:].detach().cpu().numpy().astype(bool)
