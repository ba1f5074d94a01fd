"""Host tier: a second block pool in host memory for cold cached blocks.

    >>> pool = KVPool(num_blocks=4096, host_blocks=16384)     # 4x the device pool in host memory

When the device pool evicts a cached block (reference count 0, not pinned), its K and V (every
layer) are copied here with its `BlockMeta` instead of being dropped. A later request whose
prefix reaches that digest gets it copied back into a fresh device block before its forward: on
CUDA from page-locked memory on a separate stream, which waits only for the kernels that last
used that device block (the forward's stream waits for the copy on the GPU, the host never
does), on the CPU with plain copies. Only blocks of a matched prefix are ever copied back.

When the host tier is full, its lowest-value leaf leaves it (`TierChain` passes it on to the
disk tier, if there is one): a lookup stops at the first missing block of a prefix, so dropping
an inner block would strand every block after it. The disk tier drops the same way.
"""

from __future__ import annotations

import time

import torch

from ..policy import BlockMeta, Policy
from .leaves import LeafQueue


class HostTier:
    """Host copies of evicted device blocks, found by digest. Calls happen under the pool's lock."""

    def __init__(self, num_blocks: int, block_shapes: list[tuple[int, ...]], dtype: torch.dtype, policy: Policy,
                 device: torch.device):
        if num_blocks < 1:
            raise ValueError(f"host_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.policy = num_blocks, policy
        on_cuda = device.type == "cuda"
        self.keys = [torch.zeros((num_blocks, *shape), dtype=dtype, pin_memory=on_cuda) for shape in block_shapes]
        self.values = [torch.zeros_like(k, pin_memory=on_cuda) for k in self.keys]
        self.stream = torch.cuda.Stream(device) if on_cuda else None
        self.idle_since: dict[int, torch.cuda.Event] = {}  # device block -> event after its last use
        self.by_digest: dict[bytes, int] = {}
        self.metas: dict[int, BlockMeta] = {}
        self.free_slots = list(range(num_blocks - 1, -1, -1))
        self.leaves = LeafQueue(policy)  # which slot leaves when the tier is full
        self.counters = dict.fromkeys(("demotions", "promotions", "host_drops", "copy_bytes"), 0) | {"copy_seconds": 0.0}

    def full(self) -> bool:
        return not self.free_slots

    def store(self, meta: BlockMeta, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy one block (`(key, value)` per layer, on any device) into a free slot; its digest
        must not be held yet (`TierChain.demote` asks `contains` first)."""
        slot = self.free_slots.pop()
        start = time.perf_counter()
        for host_k, host_v, (key, value) in zip(self.keys, self.values, layers):
            host_k[slot].copy_(key)  # synchronous: the device block is reused right after
            host_v[slot].copy_(value)
        self._account(start)
        self.by_digest[meta.digest], self.metas[slot] = slot, meta
        self.leaves.add(slot, meta)
        self.counters["demotions"] += 1

    def lowest(self) -> tuple[BlockMeta, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Remove an expired block or the lowest-value leaf (found by `LeafQueue`, without a
        scan); returns its metadata and data (views, valid until the next store) for the next
        tier down."""
        slot = self.leaves.lowest(self.policy.now())
        meta = self.metas[slot]
        layers = [(k[slot], v[slot]) for k, v in zip(self.keys, self.values)]
        self._remove(slot)
        self.counters["host_drops"] += 1
        return meta, layers

    def note_idle(self, blocks: list[int]) -> None:
        """`blocks` just lost their last reference, but kernels already queued may still read or
        write them: an event marks the point after which a promotion may overwrite them. Waiting
        for that event only, not for the whole forward stream, lets the copy overlap the work
        queued since."""
        if self.stream is None or not blocks:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
        self.idle_since.update(dict.fromkeys(blocks, event))

    def contains(self, digest: bytes, now: float) -> bool:
        slot = self.by_digest.get(digest)
        if slot is not None and self.metas[slot].expired(now):
            self._remove(slot)
            return False
        return slot is not None

    def load(self, digest: bytes, block: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> BlockMeta:
        """Copy the block of `digest` into device `block` (`layers`: its `(key, value)` views)
        and give the slot up; returns its metadata."""
        slot = self.by_digest[digest]
        start = time.perf_counter()
        pairs = [(dev, host[slot]) for (k, v), hk, hv in zip(layers, self.keys, self.values)
                 for dev, host in ((k, hk), (v, hv))]
        if self.stream is not None:
            last_use = self.idle_since.pop(block, None)
            if last_use is not None:  # kernels queued before the block was let go may still touch it
                self.stream.wait_event(last_use)
            with torch.cuda.stream(self.stream):
                for device, host in pairs:
                    device.copy_(host, non_blocking=True)
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        else:
            for device, host in pairs:
                device.copy_(host)
        self._account(start)
        meta = self.metas[slot]
        self._remove(slot)
        self.counters["promotions"] += 1
        return meta

    def forget(self, tenant: str | None = None, model: str | None = None) -> int:
        doomed = [s for s, m in self.metas.items()
                  if (tenant is None or m.tenant == tenant) and (model is None or m.model == model)]
        for slot in doomed:
            self._remove(slot)
        return len(doomed)

    def used(self) -> int:
        return len(self.metas)

    def bytes_per_block(self) -> int:
        return sum(t[0].nbytes for t in self.keys + self.values)

    def stats(self) -> dict:
        return {"host_blocks": self.num_blocks, "host_blocks_used": self.used(),
                "host_bytes_used": self.used() * self.bytes_per_block()} | self.counters

    def _account(self, start: float) -> None:
        self.counters["copy_bytes"] += self.bytes_per_block()
        self.counters["copy_seconds"] += time.perf_counter() - start

    def _remove(self, slot: int) -> None:
        meta = self.metas.pop(slot)
        del self.by_digest[meta.digest]
        self.leaves.remove(slot, meta)
        self.free_slots.append(slot)
