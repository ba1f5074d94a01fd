"""PagedCache: a `transformers.Cache` whose KV lives in the blocks of a shared KVPool.

    >>> hf_paged_kv.enable(model)
    >>> with PagedCache() as cache:                    # binds to the model's pool on first use
    ...     out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
    ...     # multi-turn: pass the same cache with the whole conversation; only new tokens prefill
    ...     out = model.generate(**next_turn, past_key_values=cache, max_new_tokens=32)
    # leaving the block (or `cache.release()`, or garbage collection) frees the blocks

Each batch row owns a block table and a physical length. Pad positions are never stored, so rows
of a left-padded batch hold only their real tokens. transformers still sees the logical (padded)
length through `get_seq_length()`, as with `DynamicCache`.

Rows may share blocks (reference counted): identical prompts in one batch (`num_return_sequences`)
are stored once, and beam search reorders rows by sharing. A row about to write into a shared,
partly filled block first copies it (copy-on-write).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache

from . import step
from .errors import CacheReleasedError, NotEnabledError, PagedKVError, PoolExhaustedError
from .pool import KVPool
from .reuse.prefix_index import PUBLIC_TENANT


class PagedCache(Cache):
    """Paged KV cache for `model.generate(past_key_values=PagedCache())` on an enabled model.

    Args:
        pool: the KVPool to draw blocks from. Default: the pool of the model the cache is first
            used with (`hf_paged_kv.enable(model)` creates it).
        tenant: whose KV this is. Cached prefixes are shared only within a tenant (and with
            prefixes published to all by `hf_paged_kv.publish`).
        reuse: inherit cached prefixes of earlier requests and offer this one's blocks to later
            ones (default). `False` computes everything and shares nothing.
        priority: weight of this request's cached blocks in eviction and demotion (each step
            doubles their value; see `reuse.prefix_index`).
        pin_turns: pin the first N turns of this conversation (a turn is a prefill of more
            than one token, i.e. one `generate` call) in device memory, within the pool's pin
            budget; see `hf_paged_kv.pinning`.
    """

    is_compileable = False  # True would switch on transformers' auto-compile for custom caches

    def __init__(self, pool: KVPool | None = None, tenant: str = "default", reuse: bool = True, pin_turns: int = 0,
                 priority: int = 0):
        super().__init__(layers=[])
        if not isinstance(tenant, str) or not tenant or tenant == PUBLIC_TENANT:
            raise ValueError(f"tenant must be a non-empty string other than {PUBLIC_TENANT!r}, got {tenant!r}")
        if pin_turns < 0 or (pin_turns and not reuse):
            raise ValueError("pin_turns must be >= 0, and pinned turns are only useful with reuse=True")
        self.tenant = tenant
        self.reuse = reuse
        self.pin_turns = pin_turns
        self.priority = priority
        self._turn_starts: list[list[int]] = []  # row lengths when each prefill (turn) began
        self._turns_pinned = False
        self._pool = pool
        self._chains: list[list[bytes]] = []  # digests of each row's indexed full blocks
        self._before: dict | None = None  # row state before the current forward (to undo a failure)
        self._tables: list[list[int]] = []  # block ids per row
        self._lengths: list[int] = []  # physical (stored) tokens per row
        self._history: list[bytearray] = []  # per row and logical position: 1 real, 0 pad
        self._tokens: list[list[int]] = []  # token id of each stored token (-1: unknown)
        self._logical = 0  # padded length, what transformers sees
        self._plan: step.StepPlan | None = None
        self._pending: dict | None = None  # row state after the current forward, committed on first write
        self._released = False

    # ------------------------------------------------------------- lifecycle
    @property
    def pool(self) -> KVPool | None:
        """The pool this cache draws from (None until first used with an enabled model)."""
        return self._pool

    def bind(self, pool: KVPool) -> None:
        """Attach to `pool` (done by the model's forward hook); refuses a second, different pool."""
        self._check_alive()
        if self._pool is None:
            self._pool = pool
        elif self._pool is not pool:
            raise PagedKVError(
                "this PagedCache holds blocks of another model's pool; use a fresh PagedCache per model"
            )

    def release(self) -> None:
        """Free every block this cache holds. Using the cache afterwards raises CacheReleasedError."""
        if self._released:
            return
        if self.pin_turns and self._turn_starts and not self._turns_pinned and self._pending is None:
            self._pin_first_turns(self._lengths)
        self._offer_to_semantic_index()
        self._drop_rows()
        self._released = True

    def _pin_first_turns(self, lengths: list[int]) -> None:
        """Pin each row's full blocks before `lengths` (the end of the first pin_turns turns)."""
        pool, size = self._pool, self._pool.block_size
        with pool._lock:
            for table, length in zip(self._tables, lengths):
                if length >= size:
                    pool.pins.add(table[: length // size], self.tenant, 0, None, "turns")
        self._turns_pinned = True

    def _offer_to_semantic_index(self) -> None:
        pool = self._pool
        if not (self.reuse and pool is not None and pool.semantic is not None and self._pending is None):
            return
        with pool._lock:
            for tokens, table in zip(self._tokens, self._tables):
                pool.semantic.add(pool, self.tenant, tokens, table)

    def __enter__(self) -> "PagedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: the pool may already be gone
            pass

    def _check_alive(self) -> None:
        if self._released:
            raise CacheReleasedError("this PagedCache was released; create a new PagedCache()")

    def _drop_rows(self) -> None:
        if self._pool is not None:
            for table in self._tables:
                self._pool.decref(table)
        self._tables, self._lengths, self._history, self._tokens, self._chains = [], [], [], [], []
        self._logical = 0
        self._plan = self._pending = self._before = None

    # --------------------------------------------------- transformers protocol
    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._check_alive()
        return self._logical

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._logical + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def __len__(self) -> int:
        return len(self._pool.layers) if self._pool is not None and self._pool.is_bound else 0

    @property
    def batch_size(self) -> int:
        return len(self._tables) if self._tables else -1

    @property
    def is_initialized(self) -> bool:
        return bool(self._tables)

    @property
    def is_croppable(self) -> bool:
        return True

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write the new tokens' K/V (`[B, kv_heads, T, head_dim]`) into their blocks.

        Returns the inputs unchanged: the registered attention function reads the whole sequence
        from the pool through the active StepPlan.
        """
        self._check_alive()
        plan = self._plan
        if plan is None:
            raise NotEnabledError(
                "PagedCache needs its model prepared by `hf_paged_kv.enable(model)` before generate/forward"
            )
        if self._pending is not None:
            self._commit()
        if plan.backend == "triton":
            from hf_paged_kv.kernels import triton_backend

            triton_backend.write(plan, layer_idx, key_states, value_states)
        elif plan.write_src.numel():
            batch, heads, new, dim = key_states.shape
            device = key_states.device
            src, dst = plan.on("write_src", device), plan.on("write_dst", device)
            for cache, states in ((self._pool.key_cache, key_states), (self._pool.value_cache, value_states)):
                flat = states.transpose(1, 2).reshape(batch * new, heads, dim)
                cache[layer_idx].view(-1, heads, dim).index_copy_(0, dst, flat.index_select(0, src).to(cache[layer_idx].dtype))
        return key_states, value_states

    # ------------------------------------------------------ forward planning
    def begin_forward(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        batch: int,
        new: int,
        allow_reuse: bool = False,
    ) -> step.StepPlan:
        """Plan the forward about to run: inherit cached prefixes, allocate blocks, compute write
        slots and read metadata.

        Called by the model's forward pre-hook. With `allow_reuse` (the caller only needs the
        last position's logits, as `generate` does), a fresh cache inherits each row's longest
        cached prefix, and the plan's `skip` says how many leading input columns the forward
        may drop. Raises PoolExhaustedError before changing anything when the pool cannot hold
        the new tokens.
        """
        self._check_alive()
        pool = self._pool
        if self._pending is not None:
            self._rollback()
        rows = len(self._tables)
        if rows and rows != batch:
            raise PagedKVError(
                f"batch size changed from {rows} to {batch} rows within one PagedCache; "
                "use a fresh PagedCache for a new batch"
            )
        real = self._new_token_mask(attention_mask, batch, new)
        ids = input_ids.detach().cpu().numpy() if input_ids is not None else np.full((batch, new), -1)
        fresh = not rows
        lengths = np.array(self._lengths if rows else [0] * batch, dtype=np.int64)
        canonical = self._duplicate_rows(ids, real) if fresh and input_ids is not None else list(range(batch))
        tables = [list(t) for t in self._tables] if rows else [[] for _ in range(batch)]
        try:
            computed = real
            if fresh and allow_reuse and self.reuse and input_ids is not None:
                computed = self._inherit(ids, real, canonical, tables, lengths)
            counts = computed.sum(axis=1)
            skip = new - int(counts.max()) if batch else 0  # leading columns no row computes
            computed, width = computed[:, skip:], new - skip
            self._reserve(tables, lengths, counts, canonical)
        except PoolExhaustedError:
            if fresh:
                for table in tables:  # give back the inherited prefixes
                    pool.decref(table)
            raise

        new_lengths = lengths + counts
        max_blocks = max(1, max(len(t) for t in tables))
        block_tables = np.full((batch, max_blocks), -1, dtype=np.int32)
        for b, table in enumerate(tables):
            block_tables[b, : len(table)] = table
        positions = lengths[:, None] + np.cumsum(computed, axis=1) - 1  # physical position of each new token
        writes = computed & (np.asarray(canonical) == np.arange(batch))[:, None]
        rows_w, cols_w = np.nonzero(writes)
        pos_w = positions[rows_w, cols_w]
        blocks_w = block_tables[rows_w, pos_w // pool.block_size]
        with pool._lock:
            np.maximum.at(pool.fill, blocks_w, pos_w % pool.block_size + 1)

        slots = blocks_w.astype(np.int64) * pool.block_size + pos_w % pool.block_size
        slot_mapping = np.full((batch, width), -1, dtype=np.int64)
        slot_mapping[rows_w, cols_w] = slots
        self._plan = step.StepPlan(
            pool=pool,
            write_src=torch.from_numpy(rows_w * width + cols_w),
            write_dst=torch.from_numpy(slots),
            slot_mapping=torch.from_numpy(slot_mapping),
            block_tables=torch.from_numpy(block_tables),
            kv_lens=torch.from_numpy(new_lengths.astype(np.int32)),
            q_pos=torch.from_numpy(np.where(computed, positions, 0)),
            max_kv_len=int(new_lengths.max()) if batch else 0,
            uniform=bool(computed.all()) and bool((lengths == lengths[0]).all()),
            skip=skip,
        )
        self._pending = {"lengths": new_lengths.tolist(), "real": real, "ids": ids, "new": new}
        return self._plan

    def _inherit(self, ids, real, canonical, tables, lengths) -> np.ndarray:
        """Attach each row's longest cached prefix (exact block hashes, then the semantic index);
        fills `tables` and `lengths` in place and returns which new tokens still need computing.
        At least the last token of every row is computed: generate needs its logits."""
        pool, size = self._pool, self._pool.block_size
        computed = real.copy()
        counters = pool.reuse_counters
        with pool._lock:
            for b in range(len(ids)):
                if canonical[b] != b:  # same prompt as an earlier row: shares its blocks later
                    lengths[b], computed[b] = lengths[canonical[b]], computed[canonical[b]]
                    continue
                tokens = ids[b][real[b]]
                counters["lookups"] += 1
                counters["lookup_tokens"] += len(tokens)
                limit = len(tokens) - 1
                blocks = tables[b] = pool.acquire_prefix(self.tenant, tokens, max(limit, 0) // size)
                pool.pins.observe(self.tenant, list(blocks))
                length = len(blocks) * size
                counters["hit_tokens_prefix"] += length
                if pool.semantic is not None and limit > 0:
                    extended = pool.semantic.extend(pool, self.tenant, tokens, limit, blocks)
                    counters["hit_tokens_semantic"] += extended - length
                    length = extended
                lengths[b] = length
                computed[b, np.flatnonzero(real[b])[:length]] = False
        return computed

    def end_forward(self, succeeded: bool = True) -> None:
        """Called by the model's forward post-hook: the plan is spent.

        After a successful forward the rows' new full blocks join the prefix index (identical
        blocks already there are shared instead). A forward that raised is undone: the rows go
        back to their previous lengths, so half-written KV is never used or shared.
        """
        self._plan = None
        before, self._before = self._before, None
        if not succeeded:
            if self._pending is None and before is not None:
                self._restore(before)
            return
        if self.reuse and self._pending is None and self._tables:
            self._index_full_blocks()

    def _index_full_blocks(self) -> None:
        pool, size = self._pool, self._pool.block_size
        with pool._lock:
            for b, tokens in enumerate(self._tokens):
                chain, table = self._chains[b], self._tables[b]
                full = len(tokens) // size
                if full <= len(chain) or -1 in tokens[len(chain) * size : full * size]:
                    continue
                start = chain[-1] if chain else pool.index.root(self.tenant)
                digests = pool.index.extend(start, tokens[len(chain) * size : full * size])
                for position, known in pool.index.register(self.tenant, len(chain), digests, table, self.priority):
                    pool.incref([known])
                    pool.decref([table[position]])
                    table[position] = known
                chain.extend(digests)
                pool.pins.observe(self.tenant, table[: len(chain)])

    def _restore(self, before: dict) -> None:
        """Put the rows back as they were before a forward that failed after its first write."""
        if not before["lengths"]:
            self._drop_rows()
            return
        self._lengths, self._logical = before["lengths"], before["logical"]
        for history in self._history:
            del history[self._logical :]
        self._cut_rows_to_lengths()


    @staticmethod
    def _new_token_mask(attention_mask, batch: int, new: int) -> np.ndarray:
        if attention_mask is None:
            return np.ones((batch, new), dtype=bool)
        if attention_mask.dim() != 2:
            raise PagedKVError(
                f"PagedCache needs a 2D [batch, length] attention_mask (got {attention_mask.dim()}D): "
                "it reads padding from it"
            )
        return attention_mask[:, -new:].detach().cpu().numpy().astype(bool)

    @staticmethod
    def _duplicate_rows(ids: np.ndarray, real: np.ndarray) -> list[int]:
        """For each row, the first row with the same tokens and padding (itself if none)."""
        first: dict[bytes, int] = {}
        return [first.setdefault(ids[b].tobytes() + real[b].tobytes(), b) for b in range(len(ids))]

    def _reserve(self, tables, lengths, counts, canonical) -> None:
        """Grow `tables` in place for the new tokens; all-or-nothing against the pool."""
        pool, size = self._pool, self._pool.block_size
        grow, copy_on_write, shared = [], [], {}
        for b, table in enumerate(tables):
            if canonical[b] != b:
                grow.append(0)
                copy_on_write.append(False)
                continue
            total = -(-(lengths[b] + counts[b]) // size)
            grow.append(total - len(table))
            partial = table[lengths[b] // size] if counts[b] and lengths[b] % size else None
            refs = shared.setdefault(partial, int(pool.refcount[partial])) if partial is not None else 1
            copy_on_write.append(refs > 1)
            if refs > 1:
                shared[partial] = refs - 1
        with pool._lock:
            fresh = pool.allocate(sum(grow) + sum(copy_on_write))
            for b, table in enumerate(tables):
                if copy_on_write[b]:
                    index = lengths[b] // size
                    new_block = fresh.pop()
                    pool.copy_block(table[index], new_block)
                    pool.decref([table[index]])
                    table[index] = new_block
                table.extend(fresh.pop() for _ in range(grow[b]))
            for b, table in enumerate(tables):
                if canonical[b] != b:
                    table.extend(tables[canonical[b]])
                    pool.incref(tables[canonical[b]])
        self._tables = tables  # blocks now belong to this cache, whatever happens to the forward

    def _rollback(self) -> None:
        """Undo the block growth of a planned forward that never ran (it raised before its first write)."""
        self._pending = None
        if not self._lengths:
            self._drop_rows()
            return
        self._cut_rows_to_lengths()

    def _cut_rows_to_lengths(self) -> None:
        """Drop each row's tokens, digests and blocks past its length; a last block this row
        holds alone gets the matching fill level."""
        pool, size = self._pool, self._pool.block_size
        for b, table in enumerate(self._tables):
            length = self._lengths[b]
            del self._tokens[b][length:]
            del self._chains[b][length // size :]
            keep = -(-length // size)
            pool.decref(table[keep:])
            del table[keep:]
            if keep and pool.refcount[table[-1]] == 1:
                pool.fill[table[-1]] = length - (keep - 1) * size

    def _commit(self) -> None:
        """Adopt the row state planned for this forward (on its first layer's write)."""
        pending, self._pending = self._pending, None
        self._before = {"lengths": list(self._lengths), "logical": self._logical}
        real, ids, new = pending["real"], pending["ids"], pending["new"]
        if new > 1 and self.pin_turns:
            self._turn_starts.append(list(self._lengths) or [0] * len(real))
            if len(self._turn_starts) == self.pin_turns + 1 and not self._turns_pinned:
                self._pin_first_turns(self._turn_starts[-1])
        if not self._history:
            self._history = [bytearray() for _ in range(len(real))]
            self._tokens = [[] for _ in range(len(real))]
            self._chains = [[] for _ in range(len(real))]
        for b, history in enumerate(self._history):
            history.extend(real[b].astype(np.uint8).tobytes())
            self._tokens[b].extend(ids[b][real[b]].tolist())
        self._lengths = pending["lengths"]
        self._logical += new

    # ------------------------------------------------- batch reshaping (beam search, crop)
    def _select_rows(self, rows: list[int]) -> None:
        self._check_alive()
        pool = self._pool
        tables = [list(self._tables[r]) for r in rows]
        for table in tables:
            pool.incref(table)
        for table in self._tables:
            pool.decref(table)
        self._tables = tables
        self._lengths = [self._lengths[r] for r in rows]
        self._history = [bytearray(self._history[r]) for r in rows]
        self._tokens = [list(self._tokens[r]) for r in rows]
        self._chains = [list(self._chains[r]) for r in rows]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row `beam_idx[i]`, sharing its blocks."""
        if self._tables:
            self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._tables:
            self._select_rows([r for r in range(len(self._tables)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._tables:
            self._select_rows(indices.tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` logical positions (a positive value is the length to keep)."""
        self._check_alive()
        remove = self._logical - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        if remove <= 0:
            return
        keep = self._logical - remove
        for b, history in enumerate(self._history):
            self._lengths[b] -= sum(history[keep:])
            del history[keep:]
        self._cut_rows_to_lengths()
        self._logical = keep

    def reset(self) -> None:
        """Forget all tokens and free the blocks; the cache stays usable."""
        self._check_alive()
        self._drop_rows()

    def __repr__(self) -> str:
        state = "released" if self._released else f"rows={len(self._tables)}, seq_len={self._logical}"
        return f"PagedCache({state}, blocks={sum(len(t) for t in self._tables)})"

    # ------------------------------------------------------------- inspection
    def row_lengths(self) -> list[int]:
        """Stored (non-pad) tokens per row."""
        return list(self._lengths)

    def block_tables(self) -> list[list[int]]:
        return [list(t) for t in self._tables]

    def token_ids(self) -> list[list[int]]:
        """Token ids of the stored tokens of each row (-1 where the forward had only embeddings)."""
        return [list(t) for t in self._tokens]
