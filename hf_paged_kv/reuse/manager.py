"""ReuseManager: everything that decides which KV a new request may inherit and which it offers.

It owns the exact prefix index, the optional semantic index and the pins, and counts what they
do. It holds the allocator (to reference what it hands out) but not the pool: bringing a block
back from a lower tier needs the pool's tensors, so `inherit` takes a `promote` callable, and
a walk ends with `settle` (the pool's), which does the copies its promotions queued.
Every call happens under the pool's lock, except `embed`.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Callable

import numpy as np

from ..cache.sequence import Sequence
from ..pool.allocator import BlockAllocator
from ..pool.policy import BlockMeta, Policy
from .pins import PinRegistry
from .prefix_index import PrefixIndex
from .semantic import SemanticIndex

COUNTERS = ("lookups", "lookup_tokens", "hit_tokens_prefix", "hit_tokens_semantic", "hit_tokens_host",
            "hit_tokens_disk")

# promote(digest, after) -> (device block holding it, its meta, "host" | "disk") or None; `after`:
# the block before it in the prefix (placed next to it when free, so the prefix stays contiguous)
Promote = Callable[[bytes, "int | None"], "tuple[int, BlockMeta, str] | None"]


class ReuseManager:
    def __init__(self, allocator: BlockAllocator, block_size: int, policy: Policy, semantic: SemanticIndex | None,
                 pin_budget: float, hot_threshold: float | None, settle: Callable[[], None] = lambda: None):
        self.allocator, self.block_size, self.policy = allocator, block_size, policy
        self.settle = settle  # does the copies of the promotions a walk queued (`KVPool.settle`)
        self.index = PrefixIndex(block_size, policy, allocator)
        self.semantic = semantic
        if semantic is not None:  # entries' ages and the pool's ttl count on one clock
            semantic.clock = policy.now
        self.pins = PinRegistry(allocator, self.index, pin_budget, hot_threshold)
        self.counters = dict.fromkeys(COUNTERS, 0)

    # ------------------------------------------------------------- inherit
    def embed(self, tokens) -> np.ndarray | None:
        """The prompt's embedding for the semantic lookup (call outside the pool's lock)."""
        if self.semantic is None:
            return None
        self.semantic.embed_pending()
        return self.semantic.embed(tokens)

    def inherit(self, model: str, tenant: str, tokens: np.ndarray, limit: int, promote: Promote,
                vector: np.ndarray | None = None) -> tuple[list[int], int]:
        """Referenced blocks and length of the longest reusable prefix of `tokens`, at most
        `limit` tokens: cached full blocks (device, or promoted from a lower tier), then a
        verified semantic candidate, which may end inside a block (shared: the row copies it
        before writing into it)."""
        self.counters["lookups"] += 1
        self.counters["lookup_tokens"] += len(tokens)
        blocks = self._exact(model, tenant, tokens, max(limit, 0) // self.block_size, promote)
        length = len(blocks) * self.block_size
        self.counters["hit_tokens_prefix"] += length
        if self.semantic is not None and vector is not None and limit > length:
            found = self.semantic.best(tenant, model, vector, tokens, limit, length, self.allocator.version,
                                       self.block_size, partial(self.index.is_fresh, now=self.policy.now()))
            if found is not None:
                best, table = found
                table = table[: -(-best // self.block_size)]
                if table[: len(blocks)] != blocks:  # the entry's blocks continue other copies of the prefix
                    self.allocator.decref(blocks)
                    blocks = []
                extra = table[len(blocks) :]
                self.allocator.incref(extra)
                blocks += extra
                self.counters["hit_tokens_semantic"] += best - length
                length = best
        self.pins.observe(tenant, blocks[: length // self.block_size])
        return blocks, length

    def _exact(self, model: str, tenant: str, tokens, max_blocks: int, promote: Promote) -> list[int]:
        now = self.policy.now()
        pairs = self.index.digest_pairs(model, tenant, tokens, max_blocks)
        found = self._device_prefix(pairs, now)
        self.allocator.incref(found)
        try:
            for mine, published in pairs[len(found) :]:
                block = self._continuing((mine, published), found, now)
                if block is not None:
                    self.allocator.incref([block])
                else:
                    after = found[-1] if found else None
                    promoted = promote(mine, after) or promote(published, after)
                    if promoted is None:
                        break
                    block, meta, tier = promoted
                    self.index.adopt(block, meta, after)
                    self.counters[f"hit_tokens_{tier}"] += self.block_size
                found.append(block)
            self.settle()  # before anyone reads them; a copy that fails lets go of them all, below
        except BaseException:  # a promotion that raised (a full pool, a disk error, Ctrl-C): nothing is kept
            self.allocator.decref(found)
            raise
        self.index.touch(found, now)
        return found

    def _device_prefix(self, pairs: list[tuple[bytes, bytes]], now: float) -> list[int]:
        """The device blocks of the longest cached prefix whose blocks form one chain, each the
        tenant's or the published block of its depth, continuing the one before (a tenant that
        cached the start of a prompt published later whole goes on in the published chain). A row
        holding a child but not its parent would leave that parent idle, counted as evictable while
        no eviction can take it."""
        depths, continues = [], self.index.continues
        for pair in pairs:  # per depth, the blocks some chain from the root reaches
            before = depths[-1] if depths else [None]
            reached = [block for digest in pair if (block := self.index.lookup(digest, now)) is not None
                       and any(continues(block, previous) for previous in before)]
            if not reached:
                break
            depths.append(reached)
        chain = []
        for reached in reversed(depths):  # back from the deepest: the tenant's block first where both continue
            chain.append(next(block for block in reached if not chain or continues(chain[-1], block)))
        return chain[::-1]

    def _continuing(self, digests, chain: list[int], now: float) -> int | None:
        """The first of `digests`' device blocks that continues `chain`."""
        previous = chain[-1] if chain else None
        return next((block for digest in digests if (block := self.index.lookup(digest, now)) is not None
                     and self.index.continues(block, previous)), None)

    def probe(self, model: str, tenant: str, tokens, lower_tier: Callable[[bytes], str | None],
              pairs: list[tuple[bytes, bytes]] | None = None) -> dict[str, int]:
        """Tokens of the longest cached prefix of `tokens` (whole blocks), by the tier each block
        is in now; nothing is referenced, touched or moved. `pairs`: the blocks' digests from
        `PrefixIndex.digest_pairs`, when the caller keeps them."""
        now, found = self.policy.now(), dict.fromkeys(("device", "host", "disk"), 0)
        if pairs is None:
            pairs = self.index.digest_pairs(model, tenant, tokens, len(tokens) // self.block_size)
        on_device = len(self._device_prefix(pairs, now))  # the blocks inheriting would take, as `_exact`
        found["device"] = on_device * self.block_size
        for mine, published in pairs[on_device:]:
            tier = lower_tier(mine) or lower_tier(published)
            if tier is None:
                break
            found[tier] += self.block_size
        return found

    def references(self) -> dict[str, int]:
        """References the reuse machinery holds: one per pinned block and pin, one per semantic
        entry's partial block."""
        pins = sum(len(p.blocks) for p in self.pins.pins.values())
        semantic = sum(1 for e in self.semantic.entries if e.held is not None) if self.semantic is not None else 0
        return {"references_by_pins": pins, "references_by_semantic": semantic}

    # --------------------------------------------------------------- offer
    def index_sequence(self, model: str, tenant: str, sequence: Sequence, priority: int) -> None:
        """Index the sequence's full blocks not indexed yet (after a successful forward), up to
        its first gap (see `Sequence.shareable_length`). Where an identical block is already
        indexed, the sequence switches to it and drops its copy."""
        size, done = self.block_size, len(sequence.digests)
        full = sequence.shareable_length() // size
        tokens = sequence.tokens[done * size : full * size]
        if full <= done or -1 in tokens:
            return
        start = sequence.digests[-1] if done else self.index.root(model, tenant)
        digests = self.index.chain(start, tokens)
        for position, known in self.index.register(model, tenant, done, digests, sequence.blocks, priority, start):
            self.allocator.incref([known])
            self.allocator.decref([sequence.blocks[position]])
            sequence.blocks[position] = known
        sequence.digests.extend(digests)
        self.pins.observe(tenant, sequence.blocks[: len(sequence.digests)])

    def offer(self, model: str, tenant: str, sequence: Sequence) -> None:
        """Offer a finished row to the semantic index (its embedding comes later)."""
        if self.semantic is None:
            return
        shareable, size = sequence.shareable_length(), self.block_size
        if shareable % size and sequence.blocks[shareable // size] in self.index.metas:
            # a row cropped inside an indexed full block (prompt lookup's rejected tokens): its KV stays
            # the index's, which the entry must not hold as a partial block of its own
            shareable -= shareable % size
        # the digests its full blocks are indexed under now: the tenant's own chain, or the public
        # one of a published prefix it inherited
        indexed = list(itertools.takewhile(lambda meta: meta is not None,
                                           (self.index.metas.get(b) for b in sequence.blocks[: shareable // self.block_size])))
        held = self.semantic.add(tenant, model, sequence.tokens[:shareable],
                                 sequence.blocks[: -(-shareable // self.block_size)], self.allocator.version,
                                 self.block_size, [meta.digest for meta in indexed], self.policy.ttl)
        if held is not None:
            self.allocator.incref([held])
        self.allocator.decref(self.semantic.trim())

    # ------------------------------------------------------------- evict
    def evict(self, count: int, now: float) -> list[tuple[int, BlockMeta]]:
        """Free up to `count` blocks: cached prefix blocks (returned for demotion), then blocks
        held only by the oldest semantic entries."""
        self.pins.expire(now)
        victims = self.index.evict(count, now)
        freed = len(victims)
        while freed < count and self.semantic is not None:
            held = self.semantic.drop_oldest()
            if held is False:
                break
            freed += len(self.allocator.decref([held]))
        return victims

    def evictable(self) -> int:
        """Cached blocks eviction could free now (pins that ended let theirs go first)."""
        self.pins.expire(self.index.policy.now())
        held = self.semantic.held_blocks(self.allocator.refcount) if self.semantic is not None else 0
        return self.allocator.idle_cached() + held

    def forget(self, tenant: str | None = None, model: str | None = None) -> None:
        """Forget every cached prefix, semantic entry and pin of `tenant` and/or `model`
        (blocks in use stay with their sequences but are no longer shared)."""
        def of_model(blocks: list[int]) -> bool:  # a pin holds indexed blocks: the index knows their model
            return model is None or any((meta := self.index.metas.get(b)) is not None and meta.model == model
                                        for b in blocks)

        self.pins.forget(lambda pin, blocks: (tenant is None or pin.tenant == tenant) and of_model(blocks))
        self.index.forget(self.index.blocks_of(tenant, model))
        if self.semantic is not None:
            self.allocator.decref(self.semantic.forget(tenant, model))

    # ------------------------------------------------------------- stats
    def stats(self) -> dict:
        counters = dict(self.counters)
        hits = counters["hit_tokens_prefix"] + counters["hit_tokens_semantic"]
        counters["hit_rate"] = hits / counters["lookup_tokens"] if counters["lookup_tokens"] else 0.0
        semantic = self.semantic.counters if self.semantic is not None else {}
        return counters | self.index.counters | semantic | self.pins.stats()
