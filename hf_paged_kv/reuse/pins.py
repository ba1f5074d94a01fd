"""Pinning: KV that must stay in device memory whatever the load.

A pin holds one extra reference on each of its blocks, so they are never evicted (eviction
only takes blocks nobody references) while the prefix index keeps offering them for reuse.

    >>> pin = hf_paged_kv.pin(model, system_prompt, tokenizer, tenant="acme", priority=10, ttl=3600)
    >>> hf_paged_kv.unpin(model, pin)
    >>> PagedCache(pin_turns=2)          # pins the first two turns of this conversation

Pins come from three sources, shown in `KVPool.stats()["pins"]` with their reason:
- `explicit`: `hf_paged_kv.pin(...)`, default priority 0;
- `turns`: `PagedCache(pin_turns=N)`, priority 0;
- `hot`: automatic. Each cached prefix carries an exponentially decayed access count (see
  `reuse.prefix_index`); a prefix whose count reaches `hot_threshold` is pinned with priority
  -1, and unpinned when its count decays below half of that.

The **budget** (`KVPool(pin_budget=0.25)`, a fraction of the pool's blocks) bounds the distinct
pinned blocks. A new pin that does not fit displaces pins of strictly lower priority, lowest
first then oldest; if even that cannot make room, an explicit `pin` raises `PinBudgetError`
and a `turns` or `hot` pin is refused and counted in `pins_refused`, with a warning for the
first refusal only (under a full budget they come every step, and the count says the rest).
Pins expire at their TTL, or when one of their blocks passes the pool's TTL (never offered
again, it would only hold memory).

A lower budget (the load controller halves it under memory pressure) makes pins beyond it give
way, lowest priority and then oldest first; they come back, highest priority first (displacing
lower priorities as a new pin does), when the budget grows again, if their blocks are still
cached on the device under the same digests and still continue each other (a block evicted or
demoted to a lower tier in between, or a digest whose name moved to a copy on another chain,
does not come back: that pin then counts in `pins_refused`, as one that never fit does; while
it may come back it counts in `pins_given_way`).
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field

from ..arguments import integer
from ..errors import PagedKVError
from ..pool.allocator import BlockAllocator
from .prefix_index import PrefixIndex

HOT_PRIORITY = -1


class PinBudgetError(PagedKVError):
    """A pin would exceed the pin budget and no lower-priority pin can make room."""


@dataclass
class Pin:
    id: int
    blocks: list[int]
    tenant: str
    priority: int
    reason: str
    created: float
    expires: float | None = None
    tokens: int = field(default=0)


def check_settings(budget: float, hot_threshold: float | None) -> None:
    if not 0 <= budget <= 1:
        raise ValueError(f"pin_budget is a fraction of the pool in [0, 1], got {budget}")
    if hot_threshold is not None and hot_threshold <= 0:
        raise ValueError(f"hot_threshold must be > 0 (or None to disable), got {hot_threshold}")


class PinRegistry:
    """The pool's pins. Every call happens under the pool's lock.

    `hot_threshold` may be changed at any time (the load controller does); the budget changes
    through `set_budget`.
    """

    def __init__(self, allocator: BlockAllocator, index: PrefixIndex, budget: float, hot_threshold: float | None):
        check_settings(budget, hot_threshold)
        self.allocator, self.index = allocator, index
        self.budget = budget
        self.hot_threshold = hot_threshold
        self.pins: dict[int, Pin] = {}
        self.given_way: list[tuple[Pin, list[bytes]]] = []  # pins a smaller budget took, with their digests
        self._ids = itertools.count(1)
        self.refused = 0
        self.warned = False  # a refused automatic pin warns once; the count says the rest

    # ----------------------------------------------------------------- pins
    @property
    def budget_blocks(self) -> int:
        return int(self.budget * self.allocator.num_blocks)

    def add(self, blocks: list[int], tenant: str, priority: int, ttl: float | None, reason: str) -> Pin | None:
        now = self.index.policy.now()
        self.expire(now)
        blocks = list(dict.fromkeys(blocks))
        needed = len(set(blocks) - self.pinned_blocks())
        excess = len(self.pinned_blocks()) + needed - self.budget_blocks
        if excess > 0 and not self._make_room(excess, priority, set(blocks)):
            message = (f"pinning {needed} more block(s) exceeds the pin budget of {self.budget_blocks} blocks "
                       f"({len(self.pinned_blocks())} pinned, none of lower priority than {priority} to displace)")
            if reason == "explicit":
                raise PinBudgetError(message + "; unpin something, lower other pins' priority or raise pin_budget")
            self.refused += 1
            if not self.warned:
                self.warned = True
                warnings.warn(f"{reason} pin refused: {message}; further refusals are only counted in "
                              "stats()['pins_refused']", stacklevel=3)
            return None
        pin = Pin(next(self._ids), blocks, tenant, priority, reason, now, None if ttl is None else now + ttl,
                  len(blocks) * self.index.block_size)
        self.allocator.incref(blocks)
        self.pins[pin.id] = pin
        return pin

    def remove(self, pin: Pin) -> None:
        """Unpin for good (a pin that gave way to a smaller budget does not come back either). A
        pin this registry does not hold (released, expired, or another pool's: ids restart per
        pool) changes nothing."""
        self.given_way = [(p, digests) for p, digests in self.given_way if p is not pin]
        if self.pins.get(pin.id) is pin:
            del self.pins[pin.id]
            self.allocator.decref(pin.blocks)

    def pinned_blocks(self, besides: str | None = None) -> set[int]:
        """The blocks pins hold, but for the pins of reason `besides` ("hot": the automatic ones)."""
        return {b for pin in self.pins.values() if pin.reason != besides for b in pin.blocks}

    def expire(self, now: float) -> None:
        """Unpin the pins that ended (`ends`)."""
        for pin in [p for p in self.pins.values() if (end := self.ends(p)) is not None and now >= end]:
            self.remove(pin)

    def ends(self, pin: Pin) -> float | None:
        """When `pin` ends: at its TTL, or when one of its blocks passes the pool's TTL (never
        offered again, pinned it would only hold memory); None for never."""
        metas = [self.index.metas.get(block) for block in pin.blocks]
        return min([e for e in (pin.expires, *(m.expires for m in metas if m is not None)) if e is not None],
                   default=None)

    def _make_room(self, excess: int, priority: int, keep: set[int]) -> bool:
        """Unpin lower-priority pins (lowest, then oldest, first) until `excess` blocks are
        free of pins; unpins nothing when that cannot succeed."""
        victims = sorted((p for p in self.pins.values() if p.priority < priority), key=lambda p: (p.priority, p.created))
        others = [p for p in self.pins.values() if p.priority >= priority]
        protected = {b for p in others for b in p.blocks} | keep
        freed_if_all = len({b for p in victims for b in p.blocks} - protected)
        if freed_if_all < excess:
            return False
        for pin in victims:
            # counted as the union: a removed pin's blocks that the new pin holds stay pinned
            if len(self.pinned_blocks() | keep) <= self.budget_blocks:
                break
            if not set(pin.blocks) <= keep:  # one inside the new pin frees nothing: it stays
                self.remove(pin)
        return True

    # ---------------------------------------------------------- hot spots
    def observe(self, tenant: str, blocks: list[int]) -> None:
        """After a prefix (`blocks`, root first) was reused or indexed: pin its hot part, and
        unpin hot pins that cooled down."""
        if self.hot_threshold is None:
            return
        now, half_life = self.index.policy.now(), self.index.policy.half_life
        for pin in [p for p in self.pins.values() if p.reason == "hot"]:
            last = self.index.metas.get(pin.blocks[-1])
            if last is None or last.weight_at(now, half_life) < self.hot_threshold / 2:
                self.remove(pin)
        hot = [i for i, b in enumerate(blocks)
               if (m := self.index.metas.get(b)) is not None and m.weight_at(now, half_life) >= self.hot_threshold]
        if not hot:
            return
        prefix = blocks[: hot[-1] + 1]  # weights shrink with depth: the hot part is a prefix
        if set(prefix) <= self.pinned_blocks():
            return
        superseded = [p for p in self.pins.values() if p.reason == "hot" and set(p.blocks) <= set(prefix)]
        if self.add(prefix, tenant, HOT_PRIORITY, None, "hot") is not None:  # kept when the longer one is refused
            for pin in superseded:
                self.remove(pin)

    def set_budget(self, budget: float) -> None:
        """A new budget (a fraction of the pool). Pins beyond it give way, lowest priority and then
        oldest first (automatic hot-spot pins, priority -1, before any other); under a larger one,
        those that gave way come back where they fit and their blocks are still cached."""
        check_settings(budget, self.hot_threshold)
        self.budget = budget
        for pin in sorted(self.pins.values(), key=lambda p: (p.priority, p.created)):
            if len(self.pinned_blocks()) <= self.budget_blocks:
                break
            metas = [self.index.metas.get(block) for block in pin.blocks]
            self.remove(pin)
            if all(metas):  # only KV still named by its digests can be recognised later
                self.given_way.append((pin, [meta.digest for meta in metas]))
            else:  # it can never come back: lost, as a refused pin is
                self.refused += 1
        self._restore()

    def _restore(self) -> None:
        """Pins that gave way come back, highest priority first, on the device blocks their
        digests name now, if these still continue each other (a digest's name may have moved to
        a copy on another chain: such a pin is lost, as one whose KV left the device). One that
        does not fit displaces lower priorities, as a new pin does; none passes a higher one."""
        now = self.index.policy.now()
        for pin, digests in sorted(self.given_way, key=lambda entry: (-entry[0].priority, entry[0].created)):
            blocks = [self.index.lookup(digest, now) for digest in digests]
            expired = pin.expires is not None and now >= pin.expires
            if expired or not self._chained(blocks):
                self.given_way.remove((pin, digests))
                if not expired:  # lost for good, as a refused pin is
                    self.refused += 1
                continue
            excess = len(self.pinned_blocks() | set(blocks)) - self.budget_blocks
            if excess > 0 and not self._make_room(excess, pin.priority, set(blocks)):
                break
            self.given_way.remove((pin, digests))
            pin.blocks = blocks
            self.allocator.incref(blocks)
            self.pins[pin.id] = pin

    def _chained(self, blocks: list[int | None]) -> bool:
        """Whether `blocks` are all cached and each continues the one before (the first a root)."""
        return None not in blocks and all(self.index.continues(block, previous)
                                          for previous, block in zip([None, *blocks], blocks))

    def forget(self, which) -> None:
        """Unpin for good the pins `which(pin, blocks)` picks, those that gave way to a smaller
        budget included (they must not come back)."""
        for pin in [p for p in self.pins.values() if which(p, p.blocks)]:
            self.remove(pin)
        now = self.index.policy.now()
        self.given_way = [(pin, digests) for pin, digests in self.given_way
                          if not which(pin, [b for d in digests if (b := self.index.lookup(d, now)) is not None])]

    def release_all(self) -> None:
        """Drop every pin (the blocks stay cached)."""
        for pin in list(self.pins.values()):
            self.remove(pin)
        self.given_way = []

    def stats(self) -> dict:
        now = self.index.policy.now()
        self.expire(now)
        return {
            "blocks_pinned": len(self.pinned_blocks()),
            "pin_budget_blocks": self.budget_blocks,
            "pins_refused": self.refused,
            "pins_given_way": len(self.given_way),
            "pins": [
                {"id": p.id, "reason": p.reason, "tenant": p.tenant, "priority": p.priority, "blocks": len(p.blocks),
                 "tokens": p.tokens, "expires_in": None if (end := self.ends(p)) is None else max(0.0, end - now)}
                for p in self.pins.values()
            ],
        }


class TurnPins:
    """`PagedCache(pin_turns=N)`: pin the first N turns of a conversation, where a turn is one
    `generate` call (outside `generate`, a forward of more than one token). Their blocks are
    pinned when turn N + 1 begins, or when the cache is released after fewer turns."""

    def __init__(self, turns: int):
        turns = integer("pin_turns", turns)
        if turns < 0:
            raise ValueError(f"pin_turns must be >= 0, got {turns}")
        self.turns = turns
        self.starts: tuple[tuple[int, ...], ...] = ()  # stored row lengths when each turn began
        self.pinned = False

    def turn_began(self, lengths: list[int]) -> list[int] | None:
        """Record a turn that begins at row `lengths` (none in a fresh cache); returns the row
        lengths to pin up to, once the first N turns are over."""
        if not self.turns or self.pinned:
            return None
        self.starts += (tuple(lengths),)
        return list(self.starts[-1]) if len(self.starts) == self.turns + 1 else None

    def at_release(self, lengths: list[int]) -> list[int] | None:
        """Row lengths to pin up to when the conversation ends before turn N + 1."""
        return lengths if self.turns and self.starts and not self.pinned else None

    def pin(self, registry: PinRegistry, tenant: str, tables: list[list[int]], lengths: list[int],
            block_size: int) -> None:
        """Pin each row's whole blocks before `lengths` that the prefix index offers (under the
        pool's lock): blocks after a hole in a row's mask are not shared, and would only hold
        memory pinned."""
        for table, length in zip(tables, lengths):
            shared = list(itertools.takewhile(registry.index.is_cached, table[: length // block_size]))
            if shared:
                registry.add(shared, tenant, 0, None, "turns")
        self.pinned = True
