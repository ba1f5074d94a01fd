"""Host tier: a second block pool in host memory for cold cached blocks.

    >>> pool = KVPool(num_blocks=4096, host_blocks=16384)     # 4x the device pool in host memory

When the device pool must evict a cached block (reference count 0, not pinned), the block's K
and V (every layer) are copied here instead of being dropped, with the block's digest and
lifecycle data. A later request whose prefix reaches that digest gets it copied back into a
fresh device block before its forward runs: on CUDA from page-locked memory on a separate
stream, which waits only for the kernels that last used that device block (the forward's stream
waits for the copy on the GPU, the host never does), on the CPU with plain copies. Only blocks
of a matched prefix are ever copied back.

When the host tier is full, its lowest-value block is dropped (the same value as on the device:
decayed access weight × (depth + 1); expired blocks first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..reuse.prefix_index import block_value


@dataclass
class HostEntry:
    digest: bytes
    tenant: str
    depth: int
    weight: float
    last_access: float
    expires: float | None
    fill: int
    priority: int


class HostTier:
    """Host copies of evicted device blocks, found by digest. Calls happen under the pool's lock."""

    def __init__(self, pool, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"host_blocks must be >= 1, got {num_blocks}")
        self.pool = pool
        self.num_blocks = num_blocks
        on_cuda = any(spec.device.type == "cuda" for spec in pool.layers)
        shape = (num_blocks, pool.block_size)
        self.keys = [torch.zeros(shape + (s.num_kv_heads, s.head_dim), dtype=pool.dtype, pin_memory=on_cuda)
                     for s in pool.layers]
        self.values = [torch.zeros_like(k, pin_memory=on_cuda) for k in self.keys]
        self.stream = torch.cuda.Stream(pool.layers[0].device) if on_cuda else None
        self._idle_since: dict[int, torch.cuda.Event] = {}  # device block -> event after its last use
        self.by_digest: dict[bytes, int] = {}
        self.entries: dict[int, HostEntry] = {}
        self._free = list(range(num_blocks - 1, -1, -1))
        self.counters = dict.fromkeys(
            ("demotions", "promotions", "host_drops", "copy_bytes"), 0) | {"copy_seconds": 0.0}

    def demote(self, block: int, entry) -> None:
        """Copy device `block` (described by its prefix-index `entry`) into the host tier."""
        if entry.digest in self.by_digest:
            return
        if not self._free:
            self._drop_lowest()
        slot = self._free.pop()
        start = time.perf_counter()
        for host, device in zip(self.keys + self.values, self.pool.key_cache + self.pool.value_cache):
            host[slot].copy_(device[block])  # synchronous: the device block is reused right after
        self._account(start)
        self.by_digest[entry.digest] = slot
        self.entries[slot] = HostEntry(entry.digest, entry.tenant, entry.depth, entry.weight, entry.last_access,
                                       entry.expires, int(self.pool.fill[block]), entry.priority)
        self.counters["demotions"] += 1

    def note_idle(self, blocks: list[int]) -> None:
        """`blocks` just lost their last reference, but kernels already queued may still read or
        write them: an event marks the point after which a promotion may overwrite them. Waiting
        for that event only, not for the whole forward stream, lets the copy overlap the work
        queued since."""
        if self.stream is None or not blocks:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
        self._idle_since.update(dict.fromkeys(blocks, event))

    def lookup(self, digest: bytes, now: float) -> int | None:
        slot = self.by_digest.get(digest)
        if slot is None:
            return None
        expires = self.entries[slot].expires
        if expires is not None and now >= expires:
            self._remove(slot)
            return None
        return slot

    def promote(self, slot: int, block: int) -> HostEntry:
        """Copy host `slot` into device `block` and give the slot up; returns its metadata."""
        start = time.perf_counter()
        pairs = zip(self.pool.key_cache + self.pool.value_cache, self.keys + self.values)
        if self.stream is not None:
            last_use = self._idle_since.pop(block, None)
            if last_use is not None:  # kernels queued before the block was let go may still touch it
                self.stream.wait_event(last_use)
            with torch.cuda.stream(self.stream):
                for device, host in pairs:
                    device[block].copy_(host[slot], non_blocking=True)
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        else:
            for device, host in pairs:
                device[block].copy_(host[slot])
        self._account(start)
        entry = self.entries[slot]
        self.pool.fill[block] = entry.fill
        self._remove(slot)
        self.counters["promotions"] += 1
        return entry

    def used(self) -> int:
        return len(self.entries)

    def bytes_per_block(self) -> int:
        return sum(t[0].nbytes for t in self.keys + self.values)

    def _account(self, start: float) -> None:
        self.counters["copy_bytes"] += self.bytes_per_block()
        self.counters["copy_seconds"] += time.perf_counter() - start

    def _drop_lowest(self) -> None:
        now, half_life = self.pool.index.clock(), self.pool.index.half_life

        def value(slot: int) -> float:
            e = self.entries[slot]
            return block_value(e.weight, e.last_access, e.depth, e.expires, now, half_life, e.priority)

        slot = min(self.entries, key=value)
        entry = self.entries[slot]
        if self.pool.disk is not None and value(slot) > float("-inf"):  # one tier further down
            layers = [(k[slot], v[slot]) for k, v in zip(self.keys, self.values)]
            self.pool.disk.write(entry.digest, entry.tenant, entry.depth, entry.weight, entry.fill, layers,
                                 entry.priority)
        self._remove(slot)
        self.counters["host_drops"] += 1

    def _remove(self, slot: int) -> None:
        entry = self.entries.pop(slot)
        del self.by_digest[entry.digest]
        self._free.append(slot)
