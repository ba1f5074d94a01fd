"""KVPool: the preallocated block pool every PagedCache of a model draws from.

Layout (shared with the kernels): per layer one K and one V tensor of shape
`[num_blocks, block_size, num_kv_heads, head_dim]` on that layer's device. A block id names the
same token range in every layer, so the allocator below is layer-agnostic. Block metadata
(reference counts, fill levels) lives on the host in NumPy arrays: reading it never syncs a
device.

    >>> pool = KVPool(num_blocks=4096, block_size=16)      # or KVPool(max_bytes=2 << 30)
    >>> hf_paged_kv.enable(model, pool=pool)               # takes layer shapes and devices
    >>> pool.stats()["blocks_free"]
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .errors import PagedKVError, PoolExhaustedError
from .pinning import PinRegistry
from .tiers.disk import DiskTier
from .tiers.host import HostTier
from .reuse.prefix_index import PrefixIndex

DEFAULT_CPU_BYTES = 1 << 30  # 1 GiB of KV when every layer sits on the CPU
DEFAULT_DEVICE_FRACTION = 0.5  # of the free memory of each accelerator holding layers


@dataclass(frozen=True)
class LayerSpec:
    """Shape and placement of one attention layer's KV."""

    num_kv_heads: int
    head_dim: int
    device: torch.device


class KVPool:
    """Fixed-size KV blocks for one model, with a reference-counted allocator.

    Size it with exactly one of `num_blocks`, `max_bytes` (total over all layers and devices)
    or `memory_fraction` (of the free memory of each accelerator). With none, the pool takes
    `DEFAULT_DEVICE_FRACTION` of free accelerator memory, or `DEFAULT_CPU_BYTES` on the CPU.
    The tensors are allocated when the pool is bound to a model by `hf_paged_kv.enable`.
    """

    def __init__(
        self,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_bytes: int | None = None,
        memory_fraction: float | None = None,
        dtype: torch.dtype | None = None,
        ttl: float | None = None,
        half_life: float = 600.0,
        semantic=None,
        pin_budget: float = 0.25,
        hot_threshold: float | None = 8.0,
        host_blocks: int | None = None,
        disk_dir=None,
        disk_bytes: int = 1 << 30,
    ):
        if sum(x is not None for x in (num_blocks, max_bytes, memory_fraction)) > 1:
            raise ValueError("give at most one of num_blocks, max_bytes and memory_fraction")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if memory_fraction is not None and not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0 seconds, got {half_life}")
        self.block_size = block_size
        self.dtype = dtype
        self.ttl, self.half_life = ttl, half_life
        self.semantic = semantic  # optional SemanticIndex
        self.pin_budget, self.hot_threshold = pin_budget, hot_threshold
        self.host_blocks = host_blocks
        self.host: HostTier | None = None
        self.disk_dir, self.disk_bytes = disk_dir, disk_bytes
        self.disk: DiskTier | None = None
        self.reuse_counters = dict.fromkeys(
            ("lookups", "lookup_tokens", "hit_tokens_prefix", "hit_tokens_semantic", "semantic_candidates",
             "semantic_rejected"), 0)
        self._requested_blocks = num_blocks
        self._max_bytes = max_bytes
        self._memory_fraction = memory_fraction
        self.layers: list[LayerSpec] = []
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []
        self.num_blocks = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ binding
    @property
    def is_bound(self) -> bool:
        return bool(self.key_cache)

    def bind(self, layers: list[LayerSpec], dtype: torch.dtype, fingerprint: str = "") -> None:
        """Allocate the block tensors for these layers (called by `hf_paged_kv.enable`)."""
        if self.is_bound:
            if layers != self.layers or (self.dtype or dtype) != self.dtype:
                raise PagedKVError("this KVPool is already bound to a model with other layer shapes")
            return
        self.dtype = self.dtype or dtype
        self.layers = list(layers)
        self.num_blocks = self._choose_num_blocks()
        if self.num_blocks < 1:
            raise PagedKVError(
                f"the memory budget holds no block of {self.bytes_per_block} bytes; raise it"
            )
        for spec in self.layers:
            shape = (self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
            # zeros, not empty: attention may read stale slots under a mask, and 0 * NaN is NaN.
            self.key_cache.append(torch.zeros(shape, dtype=self.dtype, device=spec.device))
            self.value_cache.append(torch.zeros(shape, dtype=self.dtype, device=spec.device))
        self.refcount = np.zeros(self.num_blocks, dtype=np.int32)
        self.fill = np.zeros(self.num_blocks, dtype=np.int32)
        self.version = np.zeros(self.num_blocks, dtype=np.int64)  # bumped whenever a block is freed
        self.fingerprint = f"{fingerprint}|block_size={self.block_size}|dtype={self.dtype}"
        self.index = PrefixIndex(self.block_size, self.fingerprint, self.half_life, self.ttl)
        self.pins = PinRegistry(self, self.pin_budget, self.hot_threshold)
        if self.host_blocks:
            self.host = HostTier(self, self.host_blocks)
        if self.disk_dir is not None:
            self.disk = DiskTier(self, self.disk_dir, self.disk_bytes)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.high_water = 0

    def bytes_for(self, layers: list[LayerSpec] | None = None) -> int:
        """Bytes of one block summed over `layers` (default: all bound layers)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_layer = (2 * self.block_size * s.num_kv_heads * s.head_dim * itemsize for s in layers or self.layers)
        return sum(per_layer)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_for()

    def _choose_num_blocks(self) -> int:
        if self._requested_blocks is not None:
            return self._requested_blocks
        if self._max_bytes is not None:
            return self._max_bytes // self.bytes_per_block
        devices = {s.device for s in self.layers}
        accelerators = [d for d in devices if d.type != "cpu"]
        if not accelerators:
            fraction = self._memory_fraction
            budget = DEFAULT_CPU_BYTES if fraction is None else int(fraction * _host_memory())
            return budget // self.bytes_per_block
        fraction = self._memory_fraction or DEFAULT_DEVICE_FRACTION
        counts = []
        for device in accelerators:
            free, _ = torch.cuda.mem_get_info(device)
            on_device = [s for s in self.layers if s.device == device]
            counts.append(int(free * fraction) // self.bytes_for(on_device))
        return min(counts)

    # ---------------------------------------------------------------- allocator
    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (reference count 1 each), evicting cached blocks when the free
        list is short, or raise PoolExhaustedError (and take nothing)."""
        with self._lock:
            self.reserve_check(n)
            if n > len(self._free):
                self._evict_until_free(n)
            if n > len(self._free):  # shared semantic blocks did not free as counted
                raise PoolExhaustedError(n, len(self._free), self.num_blocks)
            ids = [self._free.pop() for _ in range(n)]
            self.refcount[ids] = 1
            self.high_water = max(self.high_water, int((self.refcount > 0).sum()))
            return ids

    def incref(self, ids) -> None:
        """Add a reference to blocks in use or cached by the prefix index (never to free ones)."""
        with self._lock:
            ids = np.asarray(ids, dtype=np.int64)
            free = [b for b in ids.tolist() if self.refcount[b] <= 0 and not self.index.is_cached(b)]
            if free:
                raise PagedKVError(f"incref of free block(s) {free}")
            np.add.at(self.refcount, ids, 1)

    def decref(self, ids) -> None:
        """Drop one reference from each block; blocks reaching zero return to the free list."""
        with self._lock:
            idle = []
            for block in ids:
                if self.refcount[block] <= 0:
                    raise PagedKVError(f"double free of block {block}")
                self.refcount[block] -= 1
                if self.refcount[block] == 0:
                    idle.append(block)
                    if not self.index.is_cached(block):
                        self._release(block)
            if self.host is not None:
                self.host.note_idle(idle)

    def _release(self, block: int) -> None:
        self.fill[block] = 0
        self.version[block] += 1
        self._free.append(block)

    def _evict_until_free(self, n: int) -> None:
        """Evict until `n` blocks are free: cached prefix blocks first (by value), then the
        oldest semantic entries' partial blocks."""
        self.pins.expire(self.index.clock())
        now = self.index.clock()
        for block, entry in self.index.evict(n - len(self._free), self.refcount):
            if not (entry.expires is not None and now >= entry.expires):  # cold, not dead: one tier down
                if self.host is not None:
                    self.host.demote(block, entry)
                elif self.disk is not None:
                    self.write_to_disk(block, entry, now)
            self._release(block)
        while len(self._free) < n and self.semantic is not None and self.semantic.drop_oldest(self):
            pass

    def write_to_disk(self, block: int, entry, now: float) -> None:
        """Store device `block`, indexed as `entry`, in the disk tier."""
        self.disk.write(entry.digest, entry.tenant, entry.depth, self.index.weight(entry, now),
                        int(self.fill[block]), self.block_layers(block), entry.priority)

    def acquire_prefix(self, tenant: str, tokens, max_blocks: int) -> list[int]:
        """Referenced blocks of the longest cached prefix of `tokens` (at most `max_blocks`),
        from the device index or, failing that, copied back from the host tier."""
        with self._lock:
            now, found = self.index.clock(), []
            for position, (mine, shared) in enumerate(self.index.digest_pairs(tenant, tokens, max_blocks)):
                block = self.index.lookup(mine, now)
                block = self.index.lookup(shared, now) if block is None else block
                if block is not None:
                    self.incref([block])
                elif (block := self._promote(mine, position, found, now)) is None:
                    if (block := self._promote(shared, position, found, now)) is None:
                        break
                found.append(block)
            self.index.touch(found, now)
            return found

    def _promote(self, digest: bytes, position: int, found: list[int], now: float) -> int | None:
        """Bring the host-tier or disk copy of `digest` back into a fresh device block (referenced)."""
        in_host = self.host is not None and self.host.lookup(digest, now) is not None
        in_disk = self.disk is not None and self.disk.contains(digest)
        if not (in_host or in_disk) or self.num_available() < 1:
            return None
        (block,) = self.allocate(1)  # may demote other blocks and so drop host slots: look again
        slot = self.host.lookup(digest, now) if self.host is not None else None
        if slot is not None:
            entry = self.host.promote(slot, block)
            weight, last, expires = entry.weight, entry.last_access, entry.expires
            tenant, priority = entry.tenant, entry.priority
        elif (disk_entry := self.disk.load(digest, block) if self.disk is not None else None) is not None:
            tenant, weight, last, priority = disk_entry.tenant, disk_entry.weight, now, disk_entry.priority
            expires = None if self.ttl is None else now + self.ttl
        else:
            self.decref([block])
            return None
        self.index.adopt(block, digest, tenant, position, found[-1] if found else None, weight, last, expires,
                         priority)
        return block

    def block_layers(self, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`(key, value)` of one block in every layer (views into the pool)."""
        return [(k[block], v[block]) for k, v in zip(self.key_cache, self.value_cache)]

    def num_free(self) -> int:
        return len(self._free)

    def num_available(self) -> int:
        """Free blocks plus cached ones that eviction could free."""
        held = self.semantic.held_blocks(self) if self.semantic is not None else 0
        return len(self._free) + self.index.evictable(self.refcount) + held

    def reserve_check(self, n: int) -> None:
        """Raise PoolExhaustedError now if `n` blocks could not be allocated."""
        with self._lock:
            if n > len(self._free) and n > self.num_available():
                raise PoolExhaustedError(n, self.num_available(), self.num_blocks)

    def clear_tenant(self, tenant: str) -> int:
        """Forget every cached prefix of `tenant` (blocks in use stay with their caches but are
        no longer shared); returns how many blocks were freed."""
        with self._lock:
            freed = 0
            for block in self.index.forget_tenant(tenant):
                if self.refcount[block] == 0:
                    self._release(block)
                    freed += 1
            if self.semantic is not None:
                freed += self.semantic.forget_tenant(tenant, self)
            return freed

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K and V in every layer (copy-on-write of a shared block)."""
        for keys, values in zip(self.key_cache, self.value_cache):
            keys[dst].copy_(keys[src])
            values[dst].copy_(values[src])
        self.fill[dst] = self.fill[src]

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict:
        """A snapshot of the pool: sizes, occupancy and the high-water mark."""
        with self._lock:
            cached = self.index.evictable(self.refcount) if self.is_bound else 0
            used = self.num_blocks - len(self._free) - cached
            reuse = dict(self.reuse_counters)
            hits = reuse["hit_tokens_prefix"] + reuse["hit_tokens_semantic"]
            reuse["hit_rate"] = hits / reuse["lookup_tokens"] if reuse["lookup_tokens"] else 0.0
            if self.is_bound:
                reuse.update(self.index.counters)
            return reuse | {
                "block_size": self.block_size,
                "num_blocks": self.num_blocks,
                "blocks_free": len(self._free),
                "blocks_used": used,
                "blocks_cached": cached,
                "blocks_used_high_water": self.high_water,
                "bytes_per_block": self.bytes_per_block if self.is_bound else 0,
                "bytes_total": self.num_blocks * self.bytes_per_block if self.is_bound else 0,
                "bytes_used": used * self.bytes_per_block if self.is_bound else 0,
                "tokens_stored": int(self.fill.sum()) if self.is_bound else 0,
            } | (self.pins.stats() if self.is_bound else {}) | self._host_stats()

    def _host_stats(self) -> dict:
        stats = {}
        if self.host is not None:
            stats |= {"host_blocks": self.host.num_blocks, "host_blocks_used": self.host.used(),
                      "host_bytes_used": self.host.used() * self.host.bytes_per_block()} | self.host.counters
        if self.disk is not None:
            stats |= {"disk_blocks": len(self.disk.catalog), "disk_bytes_used": self.disk.used_bytes(),
                      "disk_bytes_budget": self.disk.max_bytes} | self.disk.counters
        return stats

    def __repr__(self) -> str:
        if not self.is_bound:
            return f"KVPool(block_size={self.block_size}, unbound)"
        return (
            f"KVPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={len(self._free)}, layers={len(self.layers)}, dtype={self.dtype})"
        )


def _host_memory() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
