"""TierChain: where a cached block goes when it leaves the device, and how it comes back.

    device --evict--> host --full--> disk --budget--> dropped
    device <--promote-- host / disk        (when a request's prefix reaches the block)

Each step keeps the block's `BlockMeta` with its weight decayed to the moment of the move, so a
block is worth the same in every tier. Expired blocks are never demoted. Without a host tier,
evicted blocks go straight to disk; without either, they are dropped. Copies between the device
and the host are batched (see `tiers.host`): the blocks of one eviction are read in one batch,
and promotions from the host are queued and copied together by `flush`.
"""

from __future__ import annotations

import time

import torch

from ..integration.fingerprint import is_local
from ..pool.policy import BlockMeta, Policy
from . import transfer
from .disk import DiskTier
from .host import HostTier


class TierChain:
    def __init__(self, policy: Policy, host: HostTier | None = None, disk: DiskTier | None = None):
        self.policy, self.host, self.disk = policy, host, disk

    @classmethod
    def build(cls, policy: Policy, block_shapes, dtype: torch.dtype, device: torch.device, model: str,
              host_blocks: int | None, disk_dir, disk_bytes: int) -> "TierChain":
        """The tiers a KVPool asked for: `host_blocks` of host memory, a disk directory."""
        host = HostTier(host_blocks, block_shapes, dtype, policy, device) if host_blocks else None
        disk = DiskTier(disk_dir, disk_bytes, block_shapes, dtype, policy, model) if disk_dir is not None else None
        return cls(policy, host, disk)

    @property
    def empty(self) -> bool:
        return self.host is None and self.disk is None

    def demote(self, victims: list[tuple[int, BlockMeta]], tensors: list[torch.Tensor]) -> None:
        """Keep evicted device blocks (`(block, meta)`; `tensors`: the pool's keys then values)
        one tier down. Their data is read in batches (`transfer.to_host`: on CUDA one wait for a
        whole batch), before the caller can reuse the blocks."""
        if self.empty:
            return
        now = self.policy.now()
        # a block recomputed while its copy waited on the host keeps that copy
        kept = [(block, meta.as_of(now, self.policy.half_life)) for block, meta in victims
                if not meta.expired(now) and not (self.host is not None and self.host.contains(meta.digest, now))]
        for part in transfer.chunks(kept, sum(t[0].nbytes for t in tensors)):
            start = time.perf_counter()
            rows = transfer.to_host(tensors, [block for block, _ in part])
            read = time.perf_counter() - start
            if self.host is not None:
                self.host.receive(rows)
            try:
                for i, (_, meta) in enumerate(part):
                    self._keep(meta, rows, i)
            finally:  # what was stored is written even when a later move raised (Ctrl-C in a disk write)
                if self.host is not None:
                    self.host.commit(read)

    def _keep(self, meta: BlockMeta, rows: list[torch.Tensor], i: int) -> None:
        """Block `i` of a batch read from the device goes to the host (its lowest leaf moving on
        to disk when it is full), else to disk. When every host slot waits for a queued promotion
        to read it (nothing held can leave), it goes straight to disk, or is dropped."""
        if self.host is not None and not (self.host.full() and not self.host.used()):
            if self.host.full():
                dropped, data = self.host.lowest()
                if self.disk is not None:
                    self.disk.write(dropped, data)
            self.host.store(meta, i)
        elif self.disk is not None:
            self.disk.write(meta, transfer.block_of(rows, i))

    def write_to_disk(self, meta: BlockMeta, layers) -> bool:
        """`persist`: write a device block to disk now (it also stays on the device)."""
        return self.disk.write(meta.as_of(self.policy.now(), self.policy.half_life), layers)

    def has(self, digest: bytes) -> str | None:
        """Which lower tier holds `digest`: "host", "disk" or None."""
        if self.host is not None and self.host.contains(digest, self.policy.now()):
            return "host"
        if self.disk is not None and self.disk.contains(digest):
            return "disk"
        return None

    def promote(self, digest: bytes, model: str, block: int, layers) -> BlockMeta | None:
        """Bring `digest` from the host or disk tier into device `block` (`layers(block)`: its
        views, made only for a disk read): from disk copied now, from the host queued for `flush`."""
        tier = self.has(digest)
        if tier == "host":
            return self.host.load(digest, block)
        if tier == "disk":
            return self.disk.load(digest, model, layers(block))
        return None

    def queued(self) -> list[int]:
        """Device blocks whose promotion from the host is queued: not to be read before `flush`."""
        return self.host.queued_blocks() if self.host is not None else []

    def flush(self, tensors: list[torch.Tensor]) -> None:
        """Copy the queued promotions into the pool (`tensors`: keys then values)."""
        if self.host is not None:
            self.host.flush(tensors)

    def note_idle(self, blocks: list[int]) -> None:
        if self.host is not None:
            self.host.note_idle(blocks)

    def forget(self, tenant: str) -> int:
        """Forget (and delete) what the lower tiers hold of `tenant`."""
        return sum(t.forget(tenant=tenant) for t in (self.host, self.disk) if t is not None)

    def change_model(self, old: str, new: str) -> None:
        """The weights with fingerprint `old` became `new`: drop `old`'s host blocks, set its disk
        files aside for a restart on those weights (deleted instead for weights edited in place,
        which no other process has: `fingerprint.is_local`), and serve `new`'s files."""
        if self.host is not None:
            self.host.forget(model=old)
        if self.disk is not None:
            (self.disk.forget if is_local(old) else self.disk.set_aside)(model=old)
        self.serve_model(new)

    def serve_model(self, model: str) -> None:
        """Serve the disk files of `model` that were set aside or belonged to another model when
        the directory was read (weights edited in place have none)."""
        if self.disk is not None and not is_local(model):
            self.disk.serve(model)

    def stats(self) -> dict:
        return {k: v for t in (self.host, self.disk) if t is not None for k, v in t.stats().items()}
