"""Exact prefix index: full KV blocks found again by a chained hash of their tokens.

Block `i` of a sequence is named by `digest_i = blake2b(digest_{i-1} + tokens of block i)`,
starting from `digest_{-1} = blake2b(namespace)`, where the namespace is the model fingerprint
(model class, name, config, dtype, block size) and the tenant. Equal digests therefore mean the
same model, the same tenant and the same whole token prefix up to that block's end: the block's
KV is the KV the new request would compute.

Blocks stay indexed after their caches release them (reference count 0: *cached*), until
eviction needs them. Eviction takes leaf blocks (no cached block continues them) of lowest value

    value = weight(now) * (depth + 1) * 2 ** priority
    weight(now) = weight(t_last) * 0.5 ** ((now - t_last) / half_life),  +1 on every access

so recently and often used blocks stay (recency and frequency, in one decayed count), deep
blocks, whose recomputation attends over a longer prefix, are worth more, and each priority
step (`PagedCache(priority=...)`, clamped to -8..8) doubles a block's value. Expired blocks (past
their TTL) are never matched and go first. An evicted block's weight is remembered by digest
(a bounded "ghost" list): when the same prefix is computed again it starts from that decayed
weight + 1, so a prefix that keeps coming back under churn is still recognised as hot.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

PUBLIC_TENANT = "__public__"  # blocks every tenant may use, only by an explicit publish call


@dataclass
class IndexedBlock:
    digest: bytes
    tenant: str
    depth: int  # index of the block in its sequence
    parent: int | None  # the physical block holding the previous tokens
    last_access: float
    weight: float = 1.0
    expires: float | None = None
    children: int = 0
    priority: int = 0  # the highest priority of the requests that wrote or share it


class PrefixIndex:
    """Digest → block map with per-block lifecycle data. All calls happen under the pool's lock."""

    def __init__(self, block_size: int, fingerprint: str = "", half_life: float = 600.0, ttl: float | None = None,
                 clock=time.monotonic):
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.half_life = half_life
        self.ttl = ttl
        self.clock = clock
        self.by_digest: dict[bytes, int] = {}
        self.blocks: dict[int, IndexedBlock] = {}
        self.counters = {"evictions": 0, "expirations": 0}
        # Access history of evicted blocks (digest -> weight, last access), so a prefix that is
        # recomputed after eviction keeps its frequency: hot prefixes under churn still look hot.
        self.ghosts: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        self.max_ghosts = 4096

    # ------------------------------------------------------------- hashing
    def root(self, tenant: str) -> bytes:
        """The digest before a sequence's first block: its namespace."""
        return hashlib.blake2b(f"{self.fingerprint}|{tenant}".encode(), digest_size=16).digest()

    def extend(self, digest: bytes, tokens) -> list[bytes]:
        """Chained digests of the full blocks of `tokens`, continuing from `digest`."""
        data = np.asarray(tokens, dtype=np.int64)
        out = []
        for start in range(0, len(data) - self.block_size + 1, self.block_size):
            digest = hashlib.blake2b(digest + data[start : start + self.block_size].tobytes(), digest_size=16).digest()
            out.append(digest)
        return out

    # -------------------------------------------------------------- lookup
    def digest_pairs(self, tenant: str, tokens, max_blocks: int) -> list[tuple[bytes, bytes]]:
        """For each of the first `max_blocks` full blocks of `tokens`: its digest in `tenant`'s
        namespace and in the published one (a block may be found under either)."""
        head = tokens[: max_blocks * self.block_size]
        own = self.extend(self.root(tenant), head)
        public = self.extend(self.root(PUBLIC_TENANT), head) if tenant != PUBLIC_TENANT else own
        return list(zip(own, public))

    def lookup(self, digest: bytes, now: float) -> int | None:
        """The unexpired block indexed under `digest`, if any."""
        block = self.by_digest.get(digest)
        return None if block is None or self._expired(self.blocks[block], now) else block

    def touch(self, blocks: list[int], now: float) -> None:
        """Record a reuse of each block: +1 on its decayed access weight."""
        for block in blocks:
            entry = self.blocks[block]
            entry.weight = self.weight(entry, now) + 1.0
            entry.last_access = now

    def adopt(self, block: int, digest: bytes, tenant: str, depth: int, parent: int | None, weight: float,
              last_access: float, expires: float | None, priority: int = 0) -> None:
        """Index a block brought back from a lower tier under its old digest and history."""
        self.blocks[block] = IndexedBlock(digest, tenant, depth, parent, last_access,
                                          weight=weight, expires=expires, priority=priority)
        self.by_digest[digest] = block
        if parent is not None and parent in self.blocks:
            self.blocks[parent].children += 1

    # -------------------------------------------------------- registration
    def register(self, tenant: str, first: int, digests: list[bytes], table: list[int],
                 priority: int = 0) -> list[tuple[int, int]]:
        """Index blocks `first, first+1, ...` of a sequence, named by `digests`, held in `table`.

        Returns `(position, block)` replacements: where an equal block is already indexed under
        another id, the sequence should use that one and drop its own copy (deduplication).
        """
        now = self.clock()
        replacements = []
        parent = table[first - 1] if first else None
        for position, digest in enumerate(digests, start=first):
            block = table[position]
            known = self.by_digest.get(digest)
            if known is not None and known != block and not self._expired(self.blocks[known], now):
                replacements.append((position, known))
                block = known
            elif block not in self.blocks and known is None:  # (an expired twin keeps the name until evicted)
                self.blocks[block] = IndexedBlock(
                    digest, tenant, position, parent, now, weight=self._revive(digest, now),
                    expires=None if self.ttl is None else now + self.ttl, priority=priority,
                )
                self.by_digest[digest] = block
                if parent is not None and parent in self.blocks:
                    self.blocks[parent].children += 1
            if block in self.blocks:
                self.blocks[block].priority = max(self.blocks[block].priority, priority)
            parent = block
        return replacements

    # ----------------------------------------------------------- eviction
    def value(self, entry: IndexedBlock, now: float) -> float:
        return block_value(entry.weight, entry.last_access, entry.depth, entry.expires, now, self.half_life,
                           entry.priority)

    def evict(self, n: int, refcount) -> list[tuple[int, IndexedBlock]]:
        """Remove up to `n` cached blocks (reference count 0), one at a time: always the
        lowest-value leaf, so a parent becomes a candidate once its last child is gone.
        Returns them with their entries so the pool can demote or free them."""
        now = self.clock()
        heap = [(self.value(e, now), b) for b, e in self.blocks.items() if refcount[b] == 0 and e.children == 0]
        heapq.heapify(heap)
        evicted = []
        while heap and len(evicted) < n:
            _, block = heapq.heappop(heap)
            entry = self.blocks[block]
            if self._expired(entry, now):
                self.counters["expirations"] += 1
            else:
                self.counters["evictions"] += 1
                self._remember(entry)
            self._remove(block)
            evicted.append((block, entry))
            parent = self.blocks.get(entry.parent) if entry.parent is not None else None
            if parent is not None and parent.children == 0 and refcount[entry.parent] == 0:
                heapq.heappush(heap, (self.value(parent, now), entry.parent))
        return evicted

    def evictable(self, refcount) -> int:
        return sum(1 for b in self.blocks if refcount[b] == 0)

    def forget_tenant(self, tenant: str) -> list[int]:
        """Unindex every block of `tenant`; returns those no cache holds (to be freed)."""
        doomed = [b for b, e in self.blocks.items() if e.tenant == tenant]
        for block in doomed:
            self._remove(block)
        return doomed

    def is_cached(self, block: int) -> bool:
        return block in self.blocks

    # ------------------------------------------------------------- helpers
    def _remove(self, block: int) -> None:
        entry = self.blocks.pop(block)
        if self.by_digest.get(entry.digest) == block:
            del self.by_digest[entry.digest]
        if entry.parent is not None and entry.parent in self.blocks:
            self.blocks[entry.parent].children -= 1
        if entry.children:  # only forget_tenant removes inner blocks: their children lose the link
            for child in self.blocks.values():
                if child.parent == block:
                    child.parent = None

    def _remember(self, entry: IndexedBlock) -> None:
        self.ghosts[entry.digest] = (entry.weight, entry.last_access)
        self.ghosts.move_to_end(entry.digest)
        while len(self.ghosts) > self.max_ghosts:
            self.ghosts.popitem(last=False)

    def _revive(self, digest: bytes, now: float) -> float:
        """Initial weight of a newly indexed block: 1, plus the decayed weight it had when it
        was last evicted."""
        if digest not in self.ghosts:
            return 1.0
        weight, last = self.ghosts.pop(digest)
        return 1.0 + weight * 0.5 ** ((now - last) / self.half_life)

    def weight(self, entry: IndexedBlock, now: float) -> float:
        return entry.weight * 0.5 ** ((now - entry.last_access) / self.half_life)

    @staticmethod
    def _expired(entry: IndexedBlock, now: float) -> bool:
        return entry.expires is not None and now >= entry.expires


def block_value(weight: float, last_access: float, depth: int, expires: float | None, now: float,
                half_life: float, priority: int = 0) -> float:
    """The one value every tier (device, host, disk) ranks cached blocks by."""
    if expires is not None and now >= expires:
        return float("-inf")
    return weight * 0.5 ** ((now - last_access) / half_life) * (depth + 1) * 2.0 ** max(-8, min(8, priority))
