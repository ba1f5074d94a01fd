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

Around each forward the integration claims the cache (`claim`: one thread's forward at a
time); the planner (`forward_plan`) binds it to the model's pool (`bind`) and hands it the
forward's rows (`adopt`: inherited prefixes attached, blocks allocated); then the integration
calls `finish_forward` (commit the tokens, offer full blocks for reuse) or, if the forward
raised anything at all, `abort_forward`, which leaves the cache as it was before the forward
(stored tokens the forward's mask hid stay dropped, see `history`).
"""

from __future__ import annotations

import copy
import functools
import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .. import arguments
from ..errors import CacheReleasedError, NotEnabledError, PagedKVError
from ..pool import KVPool
from ..reuse.pins import TurnPins
from . import forward_plan, step
from .sequence import Sequence


_CLAIMING = threading.Lock()  # held only while a thread checks that a cache is free and claims it


@dataclass
class _Forward:
    """A claimed forward: its plan once the planner made it (`adopt`), then committed by
    `finish_forward` or undone by `abort_forward`."""

    thread: threading.Thread  # the one running it: another may not begin a forward meanwhile
    plan: forward_plan.ForwardPlan | None = None

    def runs_elsewhere(self) -> bool:
        return self.thread is not threading.current_thread() and self.thread.is_alive()


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
            pool.pin_turns(self.turn_pins, self.tenant, [s.blocks for s in sequences], pin_until)
        for sequence in sequences:
            if shareable:
                pool.offer(self._model, self.tenant, sequence)
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
        other threads' use raises until `finish_forward` or `abort_forward`."""
        with _CLAIMING:  # checking that the cache is free and claiming it are one step: two threads never both pass
            self.check_usable()
            mine = self._forward is not None and self._forward.thread is threading.current_thread()
            if not mine or self._forward.plan is not None:
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
    def bind(self, pool: KVPool, model: str) -> None:
        """Tie the cache to `pool` for the forward being planned, computed by the weights
        fingerprinted `model`. Another pool than the one it holds KV of is refused."""
        if self._pool not in (None, pool):
            raise PagedKVError("this PagedCache belongs to another pool than the model's (it was used with another "
                               "model, or given another pool): use a fresh PagedCache per model")
        self._pool = pool
        # other weights than the ones that computed this cache's KV: keep computing, never share it
        self._model = model if not self.sequences or self._model == model else None

    def adopt(self, plan: forward_plan.ForwardPlan) -> None:
        """Hold the rows `forward_plan` planned for this thread's claimed forward until it
        finishes (`finish_forward` commits them) or raises (`abort_forward` gives them back)."""
        if self._forward is None or self._forward.thread is not threading.current_thread():
            raise PagedKVError("a forward is planned on a PagedCache its thread has not claimed (PagedCache.claim)")
        self._forward.plan = plan
        self.sequences = plan.sequences
        if not plan.lengths_before:  # the forward begins the cache
            self.inherited = plan.inherited.tolist()

    def finish_forward(self) -> None:
        """The forward succeeded: adopt its tokens, offer the rows' new full blocks for reuse."""
        forward, self._forward = self._forward, None
        if forward is None or forward.plan is None:
            return
        plan = forward.plan
        pin_until = self.turn_pins.turn_began(plan.lengths_before) if plan.new_turn else None
        plan.commit(self.sequences)
        if self.reuse and self._model is not None:
            with self._pool.locked():
                for sequence in self.sequences:
                    self._pool.publish_blocks(self._model, self.tenant, sequence, self.priority)
                if pin_until:
                    self._pool.pin_turns(self.turn_pins, self.tenant, [s.blocks for s in self.sequences], pin_until)

    def abort_forward(self) -> None:
        """The forward raised (any exception, KeyboardInterrupt included): undo its planning.
        Nothing it half-wrote is ever indexed, offered, pinned or read again."""
        forward, self._forward = self._forward, None
        if forward is not None and forward.plan is not None:  # a claim alone changed nothing
            self.sequences = forward.plan.undo(self._pool, self.sequences)
            self.inherited = self.inherited if self.sequences else []

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
