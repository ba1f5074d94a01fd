"""The value of a cached block, and the one place that chooses which blocks leave a tier.

Every tier (device, host, disk) and the semantic index rank the blocks they may drop by one value

    value(now) = weight(now) * (depth + 1) * 2 ** priority
    weight(now) = weight(t_last) * 0.5 ** ((now - t_last) / half_life),   +1 on every reuse

so recently and often reused prefixes stay (recency and frequency in one decayed count), deeper
blocks, whose recomputation attends over a longer prefix, are worth more, and each priority step
(`PagedCache(priority=...)`, clamped to -8..8) doubles a block's value. Expired blocks (past
their TTL) are worth nothing and go first.

`BlockMeta` is the record that travels with a block from tier to tier; `Policy` holds the
settings a load controller may retune (half-life, TTL) and picks victims.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Iterable, Mapping

from ..arguments import seconds

MAX_PRIORITY = 8


@dataclass
class BlockMeta:
    """What a tier knows of one cached block, apart from its data."""

    digest: bytes  # chained hash of the block's tokens and every token before it (reuse.prefix_index)
    tenant: str
    depth: int  # index of the block in its sequence
    model: str = ""  # fingerprint of the weights that computed it
    weight: float = 1.0  # decayed access count, as of `last_access`
    last_access: float = 0.0  # seconds on the policy's clock
    expires: float | None = None
    priority: int = 0
    fill: int = 0  # tokens the block holds
    parent: bytes = b""  # digest of the block before it in its sequence (its namespace root for the first)

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires

    def weight_at(self, now: float, half_life: float) -> float:
        return self.weight * 0.5 ** (max(0.0, now - self.last_access) / half_life)

    def value(self, now: float, half_life: float) -> float:
        if self.expired(now):
            return float("-inf")
        priority = max(-MAX_PRIORITY, min(MAX_PRIORITY, self.priority))
        return self.weight_at(now, half_life) * (self.depth + 1) * 2.0**priority

    def touch(self, now: float, half_life: float) -> None:
        """Record one reuse."""
        self.weight = self.weight_at(now, half_life) + 1.0
        self.last_access = now

    def as_of(self, now: float, half_life: float) -> "BlockMeta":
        """A copy whose weight is decayed to `now` (what another tier or a file should store)."""
        return replace(self, weight=self.weight_at(now, half_life), last_access=now)


class Policy:
    """Decay and expiry settings shared by the tiers of one pool, and the victim chooser.

    Args:
        half_life: seconds for an unused block's access weight to halve.
        ttl: seconds a cached block may be reused after it was written (None: forever).
        clock: monotonic seconds; tests pass a manual clock.
    """

    def __init__(self, half_life: float = 600.0, ttl: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.half_life, self.ttl = seconds("half_life", half_life, optional=False), seconds("ttl", ttl)
        self.clock = clock

    def now(self) -> float:
        return self.clock()

    def new_meta(self, digest: bytes, tenant: str, depth: int, model: str, now: float, weight: float = 1.0,
                 priority: int = 0, fill: int = 0, parent: bytes = b"") -> BlockMeta:
        expires = None if self.ttl is None else now + self.ttl
        return BlockMeta(digest, tenant, depth, model, weight, now, expires, priority, fill, parent)

    def value(self, meta: BlockMeta, now: float) -> float:
        return meta.value(now, self.half_life)

    def rank(self, meta: BlockMeta) -> float:
        """`log2 value(now)` less a term that depends on `now` alone: every unexpired block's
        value decays at the same rate, so ranks order blocks as their values do at any time
        (for this half-life), and a rank taken once stays valid."""
        priority = max(-MAX_PRIORITY, min(MAX_PRIORITY, meta.priority))
        return (math.log2(max(meta.weight, 1e-300)) + meta.last_access / self.half_life + math.log2(meta.depth + 1)
                + priority)

    def evict(
        self,
        metas: Mapping[Hashable, BlockMeta],
        eligible: Iterable[Hashable],
        count: int,
        remove: Callable[[Hashable], Hashable | None],
        now: float | None = None,
    ) -> list[Hashable]:
        """Remove up to `count` of the `eligible` keys of `metas`, lowest value first.

        `remove(key)` takes the victim out of its tier and returns a key that became eligible
        by it (the prefix index returns the victim's parent once its last child is gone, so
        prefixes shrink from the leaf) or None. Returns the removed keys in order.
        """
        now = self.now() if now is None else now
        heap = [(metas[key].value(now, self.half_life), order, key) for order, key in enumerate(eligible)]
        heapq.heapify(heap)
        removed, order = [], len(heap)
        while heap and len(removed) < count:
            _, _, key = heapq.heappop(heap)
            removed.append(key)
            unlocked = remove(key)
            if unlocked is not None:
                order += 1
                heapq.heappush(heap, (metas[unlocked].value(now, self.half_life), order, unlocked))
        return removed
