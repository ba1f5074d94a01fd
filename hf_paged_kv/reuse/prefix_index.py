"""Exact prefix index: full KV blocks found again by a chained hash of their tokens.

Block `i` of a sequence is named by `digest_i = blake2b(digest_{i-1} + tokens of block i)`,
starting from `digest_{-1} = blake2b(namespace)`, where the namespace is the model fingerprint
(model class, name, config, a sample of the weights, dtype, block size) and the tenant. Equal
digests therefore mean the same model, the same tenant and the same whole token prefix up to
that block's end: the block's KV is the KV the new request would compute.

Blocks stay indexed after their caches release them (reference count 0: *cached*), until
eviction needs them. Eviction takes leaf blocks (no cached block continues them) of lowest value
(`policy.BlockMeta.value`), so a prefix shrinks from its end. An evicted block's weight is
remembered by digest (a bounded "ghost" list): when the same prefix is computed again it starts
from that decayed weight + 1, so a prefix that keeps coming back under churn still looks hot.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict

import numpy as np

from ..arguments import PUBLIC_TENANT
from ..pool.allocator import BlockAllocator
from ..pool.policy import BlockMeta, Policy

MAX_GHOSTS = 4096


class PrefixIndex:
    """Digest -> block map with each block's `BlockMeta`. Calls happen under the pool's lock."""

    def __init__(self, block_size: int, policy: Policy, allocator: BlockAllocator):
        self.block_size, self.policy, self.allocator = block_size, policy, allocator
        self.by_digest: dict[bytes, int] = {}
        self.metas: dict[int, BlockMeta] = {}
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        self.counters = {"evictions": 0, "expirations": 0}
        self.ghosts: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # digest -> (weight, last access)

    # ------------------------------------------------------------ hashing
    @staticmethod
    def root(model: str, tenant: str) -> bytes:
        """The digest before a sequence's first block: its namespace."""
        return hashlib.blake2b(f"{model}|{tenant}".encode(), digest_size=16).digest()

    def chain(self, digest: bytes, tokens) -> list[bytes]:
        """Chained digests of the full blocks of `tokens`, continuing from `digest`."""
        data = np.asarray(tokens, dtype=np.int64)
        out = []
        for start in range(0, len(data) - self.block_size + 1, self.block_size):
            digest = hashlib.blake2b(digest + data[start : start + self.block_size].tobytes(), digest_size=16).digest()
            out.append(digest)
        return out

    def digest_pairs(self, model: str, tenant: str, tokens, max_blocks: int) -> list[tuple[bytes, bytes]]:
        """For each of the first `max_blocks` full blocks of `tokens`: its digest in `tenant`'s
        namespace and in the published one (a block may be found under either)."""
        head = tokens[: max_blocks * self.block_size]
        own = self.chain(self.root(model, tenant), head)
        public = self.chain(self.root(model, PUBLIC_TENANT), head) if tenant != PUBLIC_TENANT else own
        return list(zip(own, public))

    # ------------------------------------------------------------- lookup
    def lookup(self, digest: bytes, now: float) -> int | None:
        """The unexpired block indexed under `digest`, if any."""
        block = self.by_digest.get(digest)
        return None if block is None or self.metas[block].expired(now) else block

    def touch(self, blocks: list[int], now: float) -> None:
        """Record a reuse of each block."""
        for block in blocks:
            self.metas[block].touch(now, self.policy.half_life)

    def is_cached(self, block: int) -> bool:
        return block in self.metas

    def is_fresh(self, block: int, digest: bytes | None, now: float) -> bool:
        """Whether `block` is indexed under `digest` and unexpired: it still holds the KV that
        digest names (a block rewritten in place and indexed again names other tokens)."""
        meta = self.metas.get(block)
        return meta is not None and meta.digest == digest and not meta.expired(now)

    # ------------------------------------------------------- registration
    def register(self, model: str, tenant: str, first: int, digests: list[bytes], table: list[int],
                 priority: int = 0, before: bytes = b"") -> list[tuple[int, int]]:
        """Index blocks `first, first+1, ...` of a sequence, named by `digests`, held in `table`;
        `before` is the digest the chain continues (`root` for the first block).

        Returns `(position, block)` replacements: where an equal block is already indexed under
        another id, the sequence should use that one and drop its own copy (deduplication).
        """
        now = self.policy.now()
        replacements = []
        parent = table[first - 1] if first else None
        for position, digest in enumerate(digests, start=first):
            block = table[position]
            known = self.lookup(digest, now)
            continued = known is not None and self.continues(known, parent)
            # an indexed block stays (its children continue it: a published block the tenant holds a twin of)
            if continued and known != block and block not in self.metas:
                replacements.append((position, known))
                block = known
            # new, or its twin expired or continues another block (its parent expired and was computed
            # again, here): the name moves here
            elif block not in self.metas and not continued:
                weight = self._revive(digest, now)
                # the record names the block it continues, so that the tiers tell leaves exactly: the
                # parent's own digest where the sequence inherited a block published under another
                # namespace than the one `digests` chain in, else the chain's previous link
                chained = digests[position - first - 1] if position > first else before
                named = self.metas[parent].digest if parent in self.metas else chained
                meta = self.policy.new_meta(digest, tenant, position, model, now, weight, priority, self.block_size,
                                            named)
                self._add(block, meta, parent)
            if block in self.metas:
                self.metas[block].priority = max(self.metas[block].priority, priority)
            parent = block
        return replacements

    def adopt(self, block: int, meta: BlockMeta, parent: int | None) -> None:
        """Index a block brought back from a lower tier under its old digest and history."""
        self._add(block, meta, parent)

    def continues(self, known: int, previous: int | None) -> bool:
        """Whether a sequence whose block before this one is `previous` may switch to `known`:
        only if `known` has no indexed parent or has `previous` as parent. Otherwise the row
        would reference `known` but not its parent (say an expired twin of `previous`), and that
        idle parent could not be evicted while being counted as evictable."""
        return self.parent[known] in (None, previous)

    def _add(self, block: int, meta: BlockMeta, parent: int | None) -> None:
        """Index `block`, linked to `parent` only if that is indexed: a parent outside the index
        (forgotten by `clear_tenant`, or never indexed) may be indexed later under another
        digest, and must not then lose a child it never counted."""
        linked = parent if parent in self.metas else None
        self.metas[block], self.by_digest[meta.digest] = meta, block
        self.parent[block], self.children[block] = linked, 0
        if linked is not None:
            self.children[linked] += 1
        self.allocator.set_cached(block, True)

    # ---------------------------------------------------------- eviction
    def idle_leaves(self) -> list[int]:
        refcount = self.allocator.refcount
        return [b for b, n in self.children.items() if n == 0 and refcount[b] == 0]

    def evict(self, count: int, now: float) -> list[tuple[int, BlockMeta]]:
        """Unindex up to `count` cached blocks nobody references, lowest value first and always
        a leaf; returns them with their metadata (the caller demotes or drops their data). The
        blocks are free once this returns."""
        victims: list[tuple[int, BlockMeta]] = []

        def remove(block: int) -> int | None:
            meta = self.metas[block]
            self.counters["expirations" if meta.expired(now) else "evictions"] += 1
            if not meta.expired(now):
                self._remember(meta)
            parent = self.parent[block]
            victims.append((block, meta))
            self._remove(block)
            if parent is not None and self.children.get(parent) == 0 and self.allocator.refcount[parent] == 0:
                return parent
            return None

        self.policy.evict(self.metas, self.idle_leaves(), count, remove, now)
        return victims

    def forget(self, doomed) -> list[int]:
        """Unindex the given blocks (tenant or model cleared); returns those that became free."""
        freed = [b for b in doomed if self.allocator.refcount[b] == 0]
        for block in doomed:
            self._remove(block)
        return freed

    def blocks_of(self, tenant: str | None = None, model: str | None = None) -> list[int]:
        return [b for b, m in self.metas.items()
                if (tenant is None or m.tenant == tenant) and (model is None or m.model == model)]

    def problems(self) -> dict[str, list[int]]:
        """Inconsistent links (first blocks of each kind); empty when all is well. A child count
        off by one keeps a block from ever being a leaf (never evicted, yet counted evictable),
        and so does an idle parent of a referenced block."""
        named = Counter(p for p in self.parent.values() if p is not None)
        refcount = self.allocator.refcount
        found = {
            "child counts that disagree with the index": [b for b, n in self.children.items() if n != named[b]],
            "parents outside the index": [b for b, p in self.parent.items() if p is not None and p not in self.metas],
            "idle parents of referenced blocks": sorted({p for b, p in self.parent.items()
                                                         if p is not None and refcount[b] and not refcount[p]}),
        }
        return {name: blocks[:10] for name, blocks in found.items() if blocks}

    # ------------------------------------------------------------ helpers
    def _remove(self, block: int) -> None:
        meta = self.metas.pop(block)
        if self.by_digest.get(meta.digest) == block:
            del self.by_digest[meta.digest]
        parent = self.parent.pop(block)
        if parent is not None:  # every link was counted (`_add`), and unlinked with its parent
            self.children[parent] -= 1
        if self.children.pop(block):  # an inner block (forget): its children lose the link
            for child, link in self.parent.items():
                if link == block:
                    self.parent[child] = None
        self.allocator.set_cached(block, False)

    def _remember(self, meta: BlockMeta) -> None:
        self.ghosts[meta.digest] = (meta.weight, meta.last_access)
        self.ghosts.move_to_end(meta.digest)
        while len(self.ghosts) > MAX_GHOSTS:
            self.ghosts.popitem(last=False)

    def _revive(self, digest: bytes, now: float) -> float:
        """Initial weight of a newly indexed block: 1, plus the decayed weight it had when it
        was last evicted."""
        if digest not in self.ghosts:
            return 1.0
        weight, last = self.ghosts.pop(digest)
        return 1.0 + BlockMeta(digest, "", 0, weight=weight, last_access=last).weight_at(now, self.policy.half_life)
