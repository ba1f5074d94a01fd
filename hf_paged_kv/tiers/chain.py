"""TierChain: where a cached block goes when it leaves the device, and how it comes back.

    device --evict--> host --full--> disk --budget--> dropped
    device <--promote-- host / disk        (when a request's prefix reaches the block)

Each step keeps the block's `BlockMeta` with its weight decayed to the moment of the move, so a
block is worth the same in every tier. Expired blocks are never demoted. Without a host tier,
evicted blocks go straight to disk; without either, they are dropped.
"""

from __future__ import annotations

import torch

from ..fingerprint import is_local
from ..policy import BlockMeta, Policy
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

    def demote(self, meta: BlockMeta, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep an evicted device block (`layers`: its `(key, value)` views) one tier down."""
        now = self.policy.now()
        if meta.expired(now):
            return
        meta = meta.as_of(now, self.policy.half_life)
        if self.host is not None:
            if self.host.contains(meta.digest, now):  # recomputed while its copy waited here
                return
            if self.host.full():
                dropped, data = self.host.lowest()
                if self.disk is not None:
                    self.disk.write(dropped, data)
            self.host.store(meta, layers)
        elif self.disk is not None:
            self.disk.write(meta, layers)

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
        """Copy `digest` from the host or disk tier into device `block` (`layers`: its views)."""
        tier = self.has(digest)
        if tier == "host":
            return self.host.load(digest, block, layers)
        if tier == "disk":
            return self.disk.load(digest, model, layers)
        return None

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
