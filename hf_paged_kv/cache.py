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

The integration claims the cache (`claim`: one thread's forward at a time) and calls
`begin_forward` before each forward (plan it: inherit cached prefixes, allocate, compute
slots) and then `finish_forward` or, if the forward raised anything at all,
`abort_forward`, which leaves the cache as it was before the forward (stored tokens the
forward's mask hid stay dropped, see `history`).
"""

from __future__ import annotations

import copy
import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache

from . import arguments, prefill, step
from .errors import CacheReleasedError, NotEnabledError, PagedKVError
from .pool import KVPool
from .reuse.pins import TurnPins
from .sequence import Sequence


_CLAIMING = threading.Lock()  # held only while a thread checks that a cache is free and claims it


@dataclass
class _Forward:
    """A claimed forward: planned by `begin_forward`, then committed by `finish_forward` or undone
    by `abort_forward`."""

    thread: threading.Thread  # the one running it: another may not begin a forward meanwhile
    real: np.ndarray | None = None  # [B, T] stored columns
    ids: np.ndarray | None = None  # [B, T] token ids (-1 where unknown or not to be matched: see Sequence.tokens)
    inherited: np.ndarray | None = None  # per row: leading real tokens already stored (a reused prefix)
    lengths_before: list[int] | None = None  # stored lengths before it (a fresh cache: none); None until planned
    new_turn: bool = False  # the forward begins a turn of the conversation (`pin_turns` counts them)

    def runs_elsewhere(self) -> bool:
        return self.thread is not threading.current_thread() and self.thread.is_alive()

    @property
    def planned(self) -> bool:
        return self.lengths_before is not None

    def commit(self, sequences: list[Sequence]) -> None:
        """Append to each row the tokens this forward stored after its inherited prefix."""
        for b, sequence in enumerate(sequences):
            sequence.append(self.real[b], self.ids[b][self.real[b]][self.inherited[b] :])

    def undo(self, pool: KVPool, sequences: list[Sequence]) -> list[Sequence]:
        """Give back what the forward's planning took; returns the rows as they were before it
        (none when it began the cache)."""
        with pool.locked():
            if not self.lengths_before:
                for sequence in sequences:
                    pool.decref(sequence.blocks)
                return []
            for sequence, length in zip(sequences, self.lengths_before):
                pool.decref(sequence.truncate(length, pool.block_size))
        return sequences


class PagedCache(Cache):
    """Paged KV cache for `model.generate(past_key_values=PagedCache())` on an enabled model.

    Args:
        pool: the pool of the model it is for, bound up front (another model's is refused at the
            first forward). Default: the pool of the model the cache is first used with.
        tenant: whose KV this is. Cached prefixes are shared only within a tenant (and with
            prefixes published to all by `hf_paged_kv.publish`).
        reuse: inherit cached prefixes of earlier requests and offer this one's blocks to later
            ones (default). `False` computes everything and shares nothing.
        pin_turns: pin the first N turns of this conversation (a turn is one `generate` call;
            outside `generate`, a forward of more than one token) in device memory, within the
            pool's pin budget; see `hf_paged_kv.reuse.pins`.
        priority: weight of this request's cached blocks in eviction and demotion (each step doubles
            their value; see `hf_paged_kv.policy`). A cache is used by one thread at a time.
    """

    is_compileable = False  # True would switch on transformers' auto-compile for custom caches
    is_croppable = True  # assisted decoding and prompt lookup crop rejected candidate tokens

    def __init__(self, pool: KVPool | None = None, tenant: str = "default", reuse: bool = True, pin_turns: int = 0,
                 priority: int = 0):
        super().__init__(layers=[])
        if pin_turns and not reuse:
            raise ValueError("pin_turns needs reuse=True: pinned turns are only useful to later requests")
        self.tenant, self.reuse, self.priority = arguments.tenant(tenant), reuse, arguments.priority(priority)
        self.turn_pins = TurnPins(pin_turns)
        self.sequences: list[Sequence] = []
        self.inherited: list[int] = []  # per row: prompt tokens inherited from cached prefixes
        self._pool = pool
        self._model: str | None = None  # fingerprint of the weights that computed this cache's KV
        self._forward: _Forward | None = None
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
        self.check_usable()  # never under another thread's running forward
        self.abort_forward()  # one this thread left unfinished (interrupted)
        if self._pool is not None and self.sequences:
            with self._pool.locked():
                self._release_rows(self._pool, self.sequences, offer=True)
        self.sequences, self._released = [], True

    def _release_rows(self, pool: KVPool, sequences: list[Sequence], offer: bool) -> None:
        shareable = offer and self.reuse and self._model is not None
        pin_until = self.turn_pins.at_release([s.length for s in sequences]) if shareable else None
        if pin_until:
            self.turn_pins.pin(pool.reuse.pins, self.tenant, [s.blocks for s in sequences], pin_until, pool.block_size)
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
        self.check_usable()
        if self._forward is not None:
            raise PagedKVError("a PagedCache cannot be copied during a forward")
        twin = copy.copy(self)  # settings, pool, model fingerprint
        twin.sequences, twin.inherited = [s.copy() for s in self.sequences], list(self.inherited)
        twin.turn_pins = copy.copy(self.turn_pins)
        if self._pool is not None:
            with self._pool.locked():
                for sequence in twin.sequences:
                    self._pool.incref(sequence.blocks)
        return twin

    def claim(self) -> None:
        """Reserve the cache for a forward of this thread before anything reads or changes its rows;
        other threads' use raises until `finish_forward` or `abort_forward` (`begin_forward` claims too)."""
        with _CLAIMING:  # checking that the cache is free and claiming it are one step: two threads never both pass
            self.check_usable()
            mine = self._forward is not None and self._forward.thread is threading.current_thread()
            if not mine or self._forward.planned:
                self.abort_forward()  # the previous forward never finished (interrupted)
                self._forward = _Forward(threading.current_thread())

    def check_usable(self) -> None:
        """Raise unless this thread may use the cache: not released, not in another live thread's forward."""
        if self._released:
            raise CacheReleasedError("this PagedCache was released; create a new PagedCache()")
        if self._forward is not None and self._forward.runs_elsewhere():
            raise PagedKVError("this PagedCache is in a forward on another thread: use one PagedCache per thread")

    # --------------------------------------------------- transformers protocol
    def get_seq_length(self, layer_idx: int = 0) -> int:
        self.check_usable()
        return self.sequences[0].logical_length if self.sequences else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def __len__(self) -> int:
        return len(self._pool.layers) if self._pool is not None and self._pool.is_bound else 0

    @property
    def is_initialized(self) -> bool:
        return bool(self.sequences)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Returns the new K/V unchanged: the registered attention function writes them into
        their blocks and reads the whole sequence from the pool."""
        self.check_usable()
        if step.current() is None:
            raise NotEnabledError("PagedCache needs its model prepared by `hf_paged_kv.enable(model)` before generate/forward")
        return key_states, value_states

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row `beam_idx[i]`, sharing its blocks."""
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([r for r in range(len(self.sequences)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices.tolist())

    def _select_rows(self, rows: list[int]) -> None:
        self.check_usable()
        if not self.sequences:
            return
        chosen = [self.sequences[r].copy() for r in rows]
        with self._pool.locked():
            for sequence in chosen:
                self._pool.incref(sequence.blocks)
            self._drop(self.sequences)
        self.sequences = chosen
        self.inherited = [self.inherited[r] for r in rows] if self.inherited else []

    def crop(self, max_length: int) -> None:
        """Drop the last `-max_length` logical positions if negative (what generate does); keep
        the first `max_length` if positive; 0 changes nothing (transformers' convention)."""
        self.check_usable()
        logical = self.get_seq_length()
        keep = max_length if max_length > 0 else logical + max_length
        if keep >= logical or not self.sequences:
            return
        with self._pool.locked():
            for sequence in self.sequences:
                self._pool.decref(sequence.crop(max(keep, 0), self._pool.block_size))

    def reset(self) -> None:
        """Forget all tokens and free the blocks; the cache stays usable."""
        self.check_usable()
        self._drop(self.sequences)
        self.sequences, self.inherited = [], []

    def _drop(self, sequences: list[Sequence]) -> None:
        """Release every block of `sequences`."""
        if self._pool is not None and sequences:
            with self._pool.locked():
                for sequence in sequences:
                    self._pool.decref(sequence.blocks)

    # ------------------------------------------------------ forward lifecycle
    def begin_forward(self, pool: KVPool, model: str, input_ids, stored: np.ndarray | None, shape: tuple[int, int],
                      allow_reuse: bool, logical: bool = False, new_turn: bool | None = None) -> step.StepPlan:
        """Plan the forward about to run on `pool` with the weights fingerprinted `model` (see
        `prefill.prepare_forward`; `stored`: its columns that hold tokens, None for all; `allow_reuse`:
        only the last logits are needed, as in generate; `new_turn`: it begins a turn, by default when
        it feeds more than one token). Raises PoolExhaustedError before changing anything when the pool is full."""
        real = np.ones(shape, dtype=bool) if stored is None else stored
        ids = input_ids.detach().cpu().numpy() if input_ids is not None else np.full(real.shape, -1)
        turn = real.shape[1] > 1 if new_turn is None else new_turn
        self.claim()  # the integration's claim stands
        fresh, before = not self.sequences, [s.length for s in self.sequences]
        self._forward = _Forward(threading.current_thread(), real, ids, np.zeros(len(real), dtype=np.int64), before, turn)
        try:  # planning runs outside the pool's lock where it can (the semantic index embeds text)
            self._bind(pool, model)
            if not fresh and len(self.sequences) != len(real):
                raise PagedKVError(f"batch size changed from {len(self.sequences)} to {len(real)} rows within one "
                                   "PagedCache; use a fresh PagedCache for a new batch")
            reusing = fresh and allow_reuse and self.reuse and input_ids is not None and self._model == model
            self.sequences, plan, self._forward.inherited = prefill.prepare_forward(
                pool, None if fresh else self.sequences, ids, real, (model, self.tenant) if reusing else None,
                allow_reuse, logical)
        except BaseException:
            self._forward = None  # planning changed nothing
            raise
        if fresh:
            self.inherited = self._forward.inherited.tolist()
        return plan

    def finish_forward(self) -> None:
        """The forward succeeded: adopt its tokens, offer the rows' new full blocks for reuse."""
        forward, self._forward = self._forward, None
        if forward is None or not forward.planned:
            return
        pin_until = self.turn_pins.turn_began(forward.lengths_before) if forward.new_turn else None
        forward.commit(self.sequences)
        if self.reuse and self._model is not None:
            with self._pool.locked():
                for sequence in self.sequences:
                    self._pool.reuse.index_sequence(self._model, self.tenant, sequence, self.priority)
                if pin_until:
                    self.turn_pins.pin(self._pool.reuse.pins, self.tenant, [s.blocks for s in self.sequences], pin_until,
                                       self._pool.block_size)

    def abort_forward(self) -> None:
        """The forward raised (any exception, KeyboardInterrupt included): undo its planning.
        Nothing it half-wrote is ever indexed, offered, pinned or read again."""
        forward, self._forward = self._forward, None
        if forward is not None and forward.planned:  # a claim alone changed nothing
            self.sequences = forward.undo(self._pool, self.sequences)
            self.inherited = self.inherited if self.sequences else []

    def _bind(self, pool: KVPool, model: str) -> None:
        if self._pool not in (None, pool):
            raise PagedKVError("this PagedCache belongs to another pool than the model's (it was used with another "
                               "model, or given another pool): use a fresh PagedCache per model")
        self._pool = pool
        # other weights than the ones that computed this cache's KV: keep computing, never share it
        self._model = model if not self.sequences or self._model == model else None

    # ---------------------------------------------------------- inspection
    def row_lengths(self) -> list[int]:
        """Stored (non-pad) tokens per row."""
        return [s.length for s in self.sequences]

    def block_tables(self) -> list[list[int]]:
        return [list(s.blocks) for s in self.sequences]

    def token_ids(self) -> list[list[int]]:
        """Token ids of the stored tokens of each row (-1 where unknown: see `Sequence.tokens`)."""
        return [list(s.tokens) for s in self.sequences]

    def __repr__(self) -> str:
        rows = f"rows={len(self.sequences)}, seq_len={len(self.sequences[0].history) if self.sequences else 0}"
        return f"PagedCache({'released' if self._released else rows}, blocks={sum(len(s.blocks) for s in self.sequences)})"
