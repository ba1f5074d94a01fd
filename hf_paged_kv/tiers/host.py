"""Host tier: a second block pool in host memory for cold cached blocks.

    >>> pool = KVPool(num_blocks=4096, host_blocks=16384)     # 4x the device pool in host memory

When the device pool evicts a cached block (reference count 0, not pinned), its K and V (every
layer) are copied here with its `BlockMeta` instead of being dropped. A later request whose
prefix reaches that digest gets it copied back into a fresh device block before its forward: on
CUDA from page-locked memory on a separate stream, which waits only for the kernels that last
used that device block (the forward's stream waits for the copy on the GPU, the host never
does), on the CPU with plain copies. Only blocks of a matched prefix are ever copied back.

Copies are batched (`transfer`): a burst of blocks costs a fixed number of operations per layer
tensor, not one copy per block and tensor (256 blocks of a 30-layer model took 15,360 copies of
~10 us of host time each, and a host-tier hit was slower than recomputing the prompt).

- Demotion: `TierChain.demote` reads all the blocks one eviction frees in one batch (on CUDA one
  wait for the whole batch, where each block's copies waited before) before the pool can reuse
  them; `store` only takes slots and `commit` writes them, one copy per tensor. A block stored
  from the batch that must leave again before `commit` (the tier is full and it is already the
  lowest leaf) hands the next tier its staged rows. The read stays synchronous: an asynchronous
  one would make every later reader of the slot and writer of the block wait for it.
- Promotion: `load` does the bookkeeping of one block at once – the pool allocates it, the walk
  adopts it into the index, exactly as before – and only queues its copy; `flush` copies all the
  queued blocks in one batch. Deferring the data only keeps every decision of the walk
  (`ReuseManager._exact`: allocations that may evict, blocks that come from disk
  instead, a walk that stops halfway) as it was, where collecting the walk first and allocating
  after would have had to redo them. What deferring must guarantee: nothing reads a queued block
  before `flush`, and no slot is reused before `flush` has read it. The slot stays taken until
  then; the pool holds one more reference on the block while its copy is queued, so no eviction
  (demotion), `decref` or failure path frees or reuses it; and the pool flushes at the end of every walk, inside the
  walk's exception handling, and when its lock is let go (`promotion`), so a forward, a disk
  write or `audit` never sees a queued block. A flush that fails unindexes its blocks. An
  eviction inside a walk when every slot is queued sends its block straight to disk.
- CUDA: the flush runs on the side stream after the last use of every target block
  (`note_idle`: waiting for those events only), and the forward's stream waits for it on the
  GPU, never the host. A run of slots is copied in place, so the host writes a slot (`commit`)
  only once the side stream is done.

When the host tier is full, its lowest-value leaf leaves it (`TierChain` passes it on to the
disk tier, if there is one): a lookup stops at the first missing block of a prefix, so dropping
an inner block would strand every block after it. The disk tier drops the same way.
"""

from __future__ import annotations

import time

import torch

from ..pool.policy import BlockMeta, Policy
from . import transfer
from .leaves import LeafQueue

COUNTERS = ("demotions", "promotions", "host_drops", "copy_bytes", "copy_batches")


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
        self.staged: list[torch.Tensor] = []  # the batch being demoted (`receive`), until `commit`
        self.incoming: dict[int, int] = {}  # slot -> its block's row in `staged`, until `commit` writes it
        self.queue: list[tuple[int, int]] = []  # (slot, device block) of promotions `flush` has not copied yet
        self.counters = dict.fromkeys(COUNTERS, 0) | {"copy_seconds": 0.0}

    def full(self) -> bool:
        return not self.free_slots

    # ------------------------------------------------------------ demotion
    def receive(self, rows: list[torch.Tensor]) -> None:
        """The batch the next `store`s take their blocks from (`rows`: host tensors, keys then
        values, `[n, *block]` each, left alone until `commit`). Its first blocks take the free
        slots in descending order: evictions come leaf first, so a prefix then lies in ascending
        slots from its root, the order a promotion walk reads them in (one run: copied in place)."""
        assert not self.incoming, "a demoted batch was stored but not committed"
        self.staged, count = rows, len(rows[0])
        if count > 1:
            self.free_slots[-count:] = self.free_slots[-count:][::-1]

    def store(self, meta: BlockMeta, row: int) -> None:
        """Take a free slot for block `row` of the batch `receive` gave; `commit` writes it. Its
        digest must not be held yet (`TierChain.demote` asks `contains` first)."""
        slot = self.free_slots.pop()
        self.incoming[slot] = row
        self.by_digest[meta.digest], self.metas[slot] = slot, meta
        self.leaves.add(slot, meta)
        self.counters["demotions"] += 1

    def commit(self, read_seconds: float = 0.0) -> None:
        """Write the blocks `store` took slots for: per host tensor one copy for all of them.
        `read_seconds`: what reading them from the device took (counted in `copy_seconds`)."""
        if not self.incoming:
            return
        start = time.perf_counter()
        if self.stream is not None:  # a queued promotion from a run of slots reads them in place
            self.stream.synchronize()
        slots, rows = list(self.incoming), list(self.incoming.values())
        try:
            for host, staged in zip(self.keys + self.values, self.staged):
                transfer.scatter(host, slots, transfer.gather(staged, rows))
        except BaseException:  # slots half written leave the catalogue: never offered
            for slot in slots:
                self._remove(slot)
            raise
        finally:
            self.incoming, self.staged = {}, []
        self.counters["copy_batches"] += 1
        self._account(len(slots), time.perf_counter() - start + read_seconds)

    def lowest(self) -> tuple[BlockMeta, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Remove an expired block or the lowest-value leaf (found by `LeafQueue`, without a
        scan); returns its metadata and data (views, valid until the next store or `commit`) for
        the next tier down: a block stored since the last `commit` hands over its staged rows."""
        slot = self.leaves.lowest(self.policy.now())
        meta = self.metas[slot]
        row = self.incoming.get(slot)
        layers = (transfer.block_of(self.staged, row) if row is not None
                  else [(k[slot], v[slot]) for k, v in zip(self.keys, self.values)])
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

    # ----------------------------------------------------------- promotion
    def load(self, digest: bytes, block: int) -> BlockMeta:
        """Give up the block of `digest` to device `block`: returns its metadata at once and queues
        the copy for `flush` (its slot stays taken until then). The caller must not read `block`
        before `flush`."""
        slot = self.by_digest[digest]
        meta = self.metas[slot]
        self._forget(slot)
        self.queue.append((slot, block))
        self.counters["promotions"] += 1
        return meta

    def queued_blocks(self) -> list[int]:
        return [block for _, block in self.queue]

    def flush(self, targets: list[torch.Tensor]) -> None:
        """Copy every queued block into its device block (`targets`: the pool's tensors, keys then
        values, as `keys + values` here) in one batch per `transfer.CHUNK_BYTES`. On CUDA the
        copies run on the side stream once the last use of each target block is done, and the
        forward's stream waits for them on the GPU. The slots are free again afterwards, even
        when a copy raised."""
        queue, self.queue = self.queue, []
        if not queue:
            return
        start = time.perf_counter()
        try:
            if self.stream is None:
                self._copy_in(queue, targets)
            else:
                self._wait_for_last_use([block for _, block in queue])
                with torch.cuda.stream(self.stream):
                    self._copy_in(queue, targets)
        finally:
            if self.stream is not None:  # also after a failure: its blocks are reused on that stream
                torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.free_slots.extend(slot for slot, _ in reversed(queue))  # taken again in this order: a run stays one
        self._account(len(queue), time.perf_counter() - start)

    def _copy_in(self, queue: list[tuple[int, int]], targets: list[torch.Tensor]) -> None:
        for part in transfer.chunks(queue, self.bytes_per_block()):
            transfer.to_device(self.keys + self.values, [s for s, _ in part], targets, [b for _, b in part])
            self.counters["copy_batches"] += 1

    def _wait_for_last_use(self, blocks: list[int]) -> None:
        """The side stream waits for the kernels queued before each block was let go (one event
        covers all the blocks one `decref` let go)."""
        events = {id(e): e for block in blocks if (e := self.idle_since.pop(block, None)) is not None}
        for event in events.values():
            self.stream.wait_event(event)

    # -------------------------------------------------------------- upkeep
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

    def _account(self, blocks: int, seconds: float) -> None:
        self.counters["copy_bytes"] += blocks * self.bytes_per_block()
        self.counters["copy_seconds"] += seconds

    def _forget(self, slot: int) -> None:
        """Drop a slot's block from the catalogue; the slot itself is not free yet."""
        meta = self.metas.pop(slot)
        del self.by_digest[meta.digest]
        self.leaves.remove(slot, meta)
        self.incoming.pop(slot, None)

    def _remove(self, slot: int) -> None:
        self._forget(slot)
        self.free_slots.append(slot)
