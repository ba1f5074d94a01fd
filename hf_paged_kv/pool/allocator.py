"""BlockAllocator: the host-side bookkeeping of a pool's blocks.

A block is *free* (no data anyone needs), *in use* (reference count > 0) or *cached* (reference
count 0, but indexed for reuse: it stays until eviction frees it). The allocator keeps reference
counts, these states, each block's fill level and a version counter bumped whenever a block is
freed (so a stale reference to recycled data is detectable), all in NumPy arrays on the host:
reading them never waits for a device.

Placement keeps each sequence's blocks contiguous where it can, because the torch backend reads
a contiguous run of blocks as one zero-copy view: a growing sequence takes the block right after
its last one when that is free, and a new run starts in the middle of the largest free stretch,
leaving room for the run before it to grow.

Not thread-safe by itself: `KVPool` calls it under its lock.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import PagedKVError


class BlockAllocator:
    """Args:
        num_blocks: the pool's size.
        on_idle: called with the blocks each `decref` leaves unreferenced, whoever calls it (a
            sequence ending, a deduplicated copy, a trimmed semantic entry): the host tier marks
            when queued kernels are done with them before a promotion may overwrite them.
    """

    def __init__(self, num_blocks: int, on_idle: Callable[[list[int]], None] | None = None):
        self.num_blocks, self.on_idle = num_blocks, on_idle
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self.free = np.ones(num_blocks, dtype=bool)
        self.cached = np.zeros(num_blocks, dtype=bool)
        self.fill = np.zeros(num_blocks, dtype=np.int32)
        self.version = np.zeros(num_blocks, dtype=np.int64)
        self.num_free = num_blocks
        self.high_water = 0

    # ------------------------------------------------------------ taking
    def take(self, count: int, after: int | None = None) -> list[int]:
        """`count` free blocks (reference count 1 each), continuing the run that ends at block
        `after` where possible. The caller checked that `count <= num_free`."""
        if count > self.num_free:
            raise PagedKVError(f"allocator asked for {count} blocks with {self.num_free} free")
        taken: list[int] = []
        if after is not None:
            block = after + 1
            while len(taken) < count and block < self.num_blocks and self.free[block]:
                taken.append(block)
                block += 1
            self._mark_taken(taken)
        while len(taken) < count:
            start, length = self._placement(count - len(taken))
            stretch = list(range(start, start + min(length, count - len(taken))))
            self._mark_taken(stretch)
            taken.extend(stretch)
        self.high_water = max(self.high_water, self.in_use())
        return taken

    def take_spread(self, counts: list[int]) -> list[list[int]]:
        """Blocks for several new sequences at once: when the largest free stretch holds them
        all, each gets a run there, evenly spaced so they can grow in step; a batch of rows of
        one length then lies at a fixed stride (one strided view reads them all). Else as `take`."""
        edges = np.diff(np.concatenate(([0], self.free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            return [self.take(c) for c in counts]
        widest = int(np.argmax(ends - starts))
        start, length = int(starts[widest]), int(ends[widest] - starts[widest])
        stride = length // len(counts)
        if stride < max(counts):
            return [self.take(c) for c in counts]
        tables = [list(range(start + i * stride, start + i * stride + c)) for i, c in enumerate(counts)]
        for table in tables:
            self._mark_taken(table)
        self.high_water = max(self.high_water, self.in_use())
        return tables

    def _mark_taken(self, blocks: list[int]) -> None:
        self.free[blocks] = False
        self.refcount[blocks] = 1
        self.num_free -= len(blocks)

    def _placement(self, count: int) -> tuple[int, int]:
        """Where the next `count` blocks go: `(start, available)` inside the largest free stretch;
        in its middle (room for the run before it to grow) unless it starts the pool."""
        edges = np.diff(np.concatenate(([0], self.free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        widest = int(np.argmax(ends - starts))
        start, length = int(starts[widest]), int(ends[widest] - starts[widest])
        if length <= count:
            return start, length
        offset = 0 if start == 0 else (length - count) // 2
        return start + offset, count

    # ------------------------------------------------------- references
    def incref(self, blocks) -> None:
        blocks = np.asarray(blocks, dtype=np.int64)
        if len(blocks) and self.free[blocks].any():
            raise PagedKVError(f"incref of free block(s) {blocks[self.free[blocks]].tolist()}")
        np.add.at(self.refcount, blocks, 1)

    def decref(self, blocks) -> list[int]:
        """Drop one reference from each block; returns those that reached zero. A block that
        reached zero and is not cached is freed."""
        idle = []
        for block in blocks:
            if self.refcount[block] <= 0:
                raise PagedKVError(f"double free of block {block}")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                idle.append(block)
                if not self.cached[block]:
                    self._free_block(block)
        if idle and self.on_idle is not None:
            self.on_idle(idle)
        return idle

    def set_cached(self, block: int, cached: bool) -> None:
        """Mark a block as indexed for reuse (it then stays when idle) or not (an idle block
        that loses its index entry is freed)."""
        self.cached[block] = cached
        if not cached and self.refcount[block] == 0 and not self.free[block]:
            self._free_block(block)

    def _free_block(self, block: int) -> None:
        self.free[block] = True
        self.fill[block] = 0
        self.version[block] += 1
        self.num_free += 1

    # --------------------------------------------------------- counting
    def idle_cached(self) -> int:
        """Cached blocks nobody references (what eviction could free)."""
        return int(np.count_nonzero(self.cached & (self.refcount == 0)))

    def held_alone(self, blocks) -> int:
        """How many of `blocks` have one reference (no other sequence, pin or semantic entry holds
        them): what their one holder's release frees or leaves evictable."""
        return int(np.count_nonzero(self.refcount[np.asarray(blocks, dtype=np.int64)] == 1))

    def referenced(self, blocks) -> int:
        """How many of `blocks` something references."""
        return int(np.count_nonzero(self.refcount[np.asarray(blocks, dtype=np.int64)] > 0))

    def in_use(self) -> int:
        return int(np.count_nonzero(self.refcount > 0))

    def runs(self, blocks: list[int]) -> int:
        """How many contiguous stretches `blocks` (a block table) consists of."""
        if not blocks:
            return 0
        table = np.asarray(blocks)
        return 1 + int(np.count_nonzero(np.diff(table) != 1))

    def problems(self, indexed: set[int]) -> dict[str, list[int]]:
        """Inconsistencies of the bookkeeping (first blocks of each kind); `indexed`: the blocks
        the prefix index holds. Empty when all is well."""
        is_indexed = np.zeros(self.num_blocks, dtype=bool)
        is_indexed[list(indexed)] = True
        found = {
            "negative reference counts": self.refcount < 0,
            "free blocks with references": self.free & (self.refcount != 0),
            "free blocks marked cached": self.free & self.cached,
            "blocks neither free, referenced nor cached": ~self.free & (self.refcount == 0) & ~self.cached,
            "cached flags that disagree with the index": self.cached != is_indexed,
        }
        problems = {name: np.flatnonzero(mask)[:10].tolist() for name, mask in found.items() if mask.any()}
        if self.num_free != int(self.free.sum()):
            problems["free count"] = [self.num_free, int(self.free.sum())]
        return problems
