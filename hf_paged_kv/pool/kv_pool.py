"""KVPool: the preallocated block pool every PagedCache (and the serving engine) of a model draws from.

Layout (shared with the kernels): per layer one K and one V tensor of shape
`[num_blocks, block_size, num_kv_heads, head_dim]` on that layer's device. A block id names the
same token range in every layer, so the allocator is layer-agnostic; its bookkeeping lives on
the host (`allocator.BlockAllocator`), so reading it never waits for a device.

    >>> pool = KVPool(num_blocks=4096, block_size=16)      # or KVPool(max_bytes=2 << 30)
    >>> hf_paged_kv.enable(model, pool=pool)               # allocates for the model's layers
    >>> pool.stats()["blocks_free"]

The pool owns its parts and routes blocks between them: the `ReuseManager` (prefix index,
semantic index, pins) decides what stays cached, the `TierChain` keeps what leaves the device.
Every operation runs under one lock (`locked()`); callers that combine several take it once.
"""

from __future__ import annotations

import collections
import itertools
import math
import mmap
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..cache.sequence import Sequence
from ..errors import PagedKVError, PoolExhaustedError
from ..reuse.manager import ReuseManager
from ..reuse.pins import Pin, TurnPins, check_settings
from ..tiers.chain import TierChain
from . import promotion, sizing
from .allocator import BlockAllocator
from .policy import BlockMeta, Policy


@dataclass(frozen=True)
class LayerSpec:
    """Shape and placement of one attention layer's KV."""

    num_kv_heads: int
    head_dim: int
    device: torch.device


class KVPool:
    """Fixed-size KV blocks for one model, with reuse, pins and memory tiers.

    Size it with at most one of `num_blocks`, `max_bytes` (total over all layers and devices)
    or `memory_fraction` (of the free memory of each accelerator, or of host memory on the
    CPU). The tensors are allocated when `hf_paged_kv.enable` binds the pool to a model; a size
    the devices cannot hold is refused before anything is allocated. See the README for the
    reuse (`ttl`, `half_life`, `semantic`), pinning (`pin_budget`, `hot_threshold`) and tier
    (`host_blocks`, `disk_dir`, `disk_bytes`) options.
    """

    def __init__(self, num_blocks: int | None = None, block_size: int = 16, max_bytes: int | None = None,
                 memory_fraction: float | None = None, dtype: torch.dtype | None = None, ttl: float | None = None,
                 half_life: float = 600.0, semantic=None, pin_budget: float = 0.25, hot_threshold: float | None = 8.0,
                 host_blocks: int | None = None, disk_dir=None, disk_bytes: int = 1 << 30):
        self.options = dict(num_blocks=num_blocks, max_bytes=max_bytes, memory_fraction=memory_fraction,
                            pin_budget=pin_budget, hot_threshold=hot_threshold, half_life=half_life,
                            host_blocks=host_blocks, disk_dir=disk_dir, disk_bytes=disk_bytes)
        sizing.check_options(block_size, self.options)
        check_settings(pin_budget, hot_threshold)
        self.block_size, self.dtype = block_size, dtype
        self.policy = Policy(half_life, ttl)
        self.semantic = semantic
        self.layers: list[LayerSpec] = []
        self.key_cache, self.value_cache = [], []  # per layer: [num_blocks, block_size, kv_heads, head_dim]
        self.num_blocks = 0
        self.allocator = self.reuse = self.tiers = None  # BlockAllocator, ReuseManager, TierChain: made by bind
        self._lock = threading.RLock()
        self._deferred: collections.deque = collections.deque()  # work queued by finalizers
        self._holds = 0  # nesting depth of locked() in the thread holding the lock

    # ------------------------------------------------------------------ binding
    @property
    def is_bound(self) -> bool:
        return bool(self.key_cache)

    def bind(self, layers: list[LayerSpec], dtype: torch.dtype, model: str = "") -> None:
        """Allocate the block tensors for these layers (called by `hf_paged_kv.enable`; `model`
        is the enabling model's fingerprint, which the disk tier checks its files against)."""
        if self.is_bound:
            if layers != self.layers or (self.dtype or dtype) != self.dtype:
                raise PagedKVError("this KVPool is already bound to a model with other layer shapes or dtype")
            with self.locked():  # a second model: its files on disk too
                self.tiers.serve_model(model)
            return
        # everything that can fail runs before anything is assigned: a failed bind leaves the
        # pool unbound (a retried enable fails the same way instead of using half a pool)
        dtype = self.dtype or dtype
        num_blocks = sizing.choose_num_blocks(self.options, layers, self.block_size, dtype)
        sizing.check_fits(layers, num_blocks, self.block_size, dtype, self.options["host_blocks"])
        shapes = [(self.block_size, s.num_kv_heads, s.head_dim) for s in layers]
        tiers = TierChain.build(self.policy, shapes, dtype, layers[0].device, model,
                                self.options["host_blocks"], self.options["disk_dir"], self.options["disk_bytes"])
        tensors = block_tensors([((num_blocks, *shape), s.device) for shape, s in zip(shapes, layers) for _ in "kv"],
                                dtype)
        self.dtype, self.num_blocks, self.layers, self.tiers = dtype, num_blocks, list(layers), tiers
        self.key_cache, self.value_cache = tensors[0::2], tensors[1::2]
        self.allocator = BlockAllocator(self.num_blocks, on_idle=self.tiers.note_idle)
        self.reuse = ReuseManager(self.allocator, self.block_size, self.policy, self.semantic,
                                  self.options["pin_budget"], self.options["hot_threshold"], self.settle)

    @property
    def bytes_per_block(self) -> int:
        return sizing.block_bytes(self.layers, self.block_size, self.dtype) if self.is_bound else 0

    @contextmanager
    def locked(self):
        """Hold the pool's lock (reentrant). Work queued by finalizers runs first; copies of
        promotions still queued when the outermost hold ends are done then (`settle`)."""
        if self.allocator is None:  # every operation on blocks takes the lock: none before enable
            raise PagedKVError("this KVPool has no blocks yet: hf_paged_kv.enable(model, pool=pool) binds it")
        with self._lock:
            self._holds += 1
            try:
                while self._deferred:
                    self._deferred.popleft()()
                yield self
            finally:
                self._holds -= 1
                if not self._holds:
                    promotion.settle(self)

    def defer(self, work) -> None:
        """Queue `work()` for the next `locked()` (from a finalizer, which must not take locks)."""
        self._deferred.append(work)

    # ---------------------------------------------------------------- allocator
    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """Take `count` blocks (reference count 1 each), continuing the run ending at `after`
        where possible; cached blocks are evicted (and demoted) when the free ones run short.
        Raises PoolExhaustedError, taking nothing, when even eviction cannot make room."""
        with self.locked():
            self._ensure_free(count)
            return self.allocator.take(count, after)

    def make_free(self, count: int) -> None:
        """Evict (and demote) cached blocks until `count` blocks are free, ahead of need."""
        with self.locked():
            self._evict(count - self.allocator.num_free)

    def _ensure_free(self, count: int) -> None:
        """Evict (and demote) cached blocks until `count` are free, or raise PoolExhaustedError
        (before evicting anything when even eviction could not make room)."""
        if count > self.allocator.num_free and count > self.num_available():
            raise PoolExhaustedError(count, self.num_available(), self.num_blocks)
        self._evict(count - self.allocator.num_free)
        if count > self.allocator.num_free:  # shared semantic blocks did not free as counted
            raise PoolExhaustedError(count, self.allocator.num_free, self.num_blocks)

    def _evict(self, count: int) -> None:
        if count <= 0:
            return
        self.tiers.demote(self.reuse.evict(count, self.policy.now()), self.key_cache + self.value_cache)

    def incref(self, blocks) -> None:
        """Add a reference to blocks in use or cached (never to free ones)."""
        with self.locked():
            self.allocator.incref(blocks)

    def decref(self, blocks) -> None:
        """Drop one reference from each block; unindexed blocks reaching zero are freed."""
        with self.locked():
            self.allocator.decref(blocks)

    def num_free(self) -> int:
        return self.allocator.num_free

    def num_available(self) -> int:
        """Free blocks plus the cached ones eviction could free."""
        with self.locked():
            return self.allocator.num_free + self.reuse.evictable()

    # ----------------------------------------------------------- block content
    def block_layers(self, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`(key, value)` of one block in every layer (views into the pool)."""
        return [(k[block], v[block]) for k, v in zip(self.key_cache, self.value_cache)]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K and V in every layer."""
        for keys, values in zip(self.key_cache, self.value_cache):
            keys[dst].copy_(keys[src])
            values[dst].copy_(values[src])
        self.allocator.fill[dst] = self.allocator.fill[src]

    def grow(self, sequences: list[Sequence], counts) -> None:
        """Give each sequence the blocks for `counts[i]` more stored tokens, all or nothing
        (PoolExhaustedError, nothing changed). A sequence about to write into a block it shares,
        or one the prefix index offers, first gets its own copy (copy-on-write)."""
        size = self.block_size
        with self.locked():
            shared = collections.Counter()
            copies = []
            for sequence, count in zip(sequences, counts):
                partial = sequence.partial_block(size) if count else None
                # never write into a block others hold or the index offers (it names other tokens)
                others = self.allocator.refcount[partial] - shared[partial] > 1 if partial is not None else False
                if partial is not None and (others or self.allocator.cached[partial]):
                    shared[partial] += 1
                    copies.append(sequence)
            needed = sum(s.blocks_needed(c, size) for s, c in zip(sequences, counts) if c) + len(copies)
            self._ensure_free(needed)
            take = self.allocator.take
            for sequence in copies:
                index = sequence.length // size
                (fresh,) = take(1, after=sequence.blocks[index - 1] if index else None)
                self.copy_block(sequence.blocks[index], fresh)
                self.decref([sequence.blocks[index]])
                sequence.blocks[index] = fresh
            fresh = [(s, s.blocks_needed(c, size)) for s, c in zip(sequences, counts) if c and not s.blocks]
            if len(fresh) > 1:  # a new batch: rows spread evenly, to grow in step
                for (sequence, _), table in zip(fresh, self.allocator.take_spread([n for _, n in fresh])):
                    sequence.blocks = table
            for sequence, count in zip(sequences, counts):
                missing = sequence.blocks_needed(count, size) if count else 0
                if missing > 0:
                    sequence.blocks += take(missing, after=sequence.blocks[-1] if sequence.blocks else None)

    def mark_written(self, slots: np.ndarray) -> None:
        """Fill levels after a forward writes `slots` (for `tokens_stored`)."""
        slots = slots[slots >= 0]
        np.maximum.at(self.allocator.fill, slots // self.block_size, (slots % self.block_size + 1).astype(np.int32))

    # -------------------------------------------------------------------- reuse
    def digest_pairs(self, model: str, tenant: str, tokens, max_blocks: int) -> list[tuple[bytes, bytes]]:
        """The digests of the first `max_blocks` full blocks of `tokens`: each in `tenant`'s
        namespace and in the published one (a block may be cached under either)."""
        return self.reuse.index.digest_pairs(model, tenant, tokens, max_blocks)

    def probe(self, model: str, tenant: str, tokens, pairs: list[tuple[bytes, bytes]] | None = None,
              lower_tiers: bool = True) -> dict[str, int]:
        """Tokens of the longest cached prefix of `tokens` (whole blocks) by the tier each block is
        in now ("device", "host", "disk"; the lower tiers only if `lower_tiers`); nothing is
        referenced, touched or moved. `pairs`: their `digest_pairs`, when the caller keeps them."""
        with self.locked():
            lower = self.tiers.has if lower_tiers else (lambda digest: None)
            return self.reuse.probe(model, tenant, tokens, lower, pairs)

    def stored_prefix(self, pairs: list[tuple[bytes, bytes]]) -> tuple[list[int], int]:
        """`(device blocks, tokens)` of the cached prefix of these blocks' digests that inheriting
        would store: its blocks in any tier, and of those the ones on the device. Nothing is
        referenced, touched or moved."""
        with self.locked():
            now, lookup, blocks, stored = self.policy.now(), self.reuse.index.lookup, [], 0
            for mine, published in pairs:
                block = lookup(mine, now)
                block = lookup(published, now) if block is None else block
                if block is not None:
                    blocks.append(block)
                elif not (self.tiers.has(mine) or self.tiers.has(published)):
                    break
                stored += self.block_size
            return blocks, stored

    def is_cached(self, digest: bytes) -> bool:
        """Whether a device block is cached under `digest` now."""
        with self.locked():
            return self.reuse.index.lookup(digest, self.policy.now()) is not None

    def inherit(self, model: str, tenant: str, tokens, limit: int, vector: np.ndarray | None = None
                ) -> tuple[list[int], int]:
        """Referenced blocks and length of the longest reusable prefix of `tokens`, at most `limit`
        tokens (blocks in a lower tier are brought back; see `ReuseManager.inherit`)."""
        with self.locked():
            return self.reuse.inherit(model, tenant, np.asarray(tokens, dtype=np.int64), limit,
                                      lambda digest, after: self.promote(digest, model, after), vector)

    def publish_blocks(self, model: str, tenant: str, sequence: Sequence, priority: int = 0) -> None:
        """Index the sequence's newly full blocks (after a forward stored them), so that later
        requests of `tenant` with the same prefix inherit them."""
        with self.locked():
            self.reuse.index_sequence(model, tenant, sequence, priority)

    def offer(self, model: str, tenant: str, sequence: Sequence) -> None:
        """Offer a finished row to the semantic index (its embedding is computed later)."""
        with self.locked():
            self.reuse.offer(model, tenant, sequence)

    def embed(self, tokens) -> np.ndarray | None:
        """A prompt's sentence embedding for the semantic lookup (None without a semantic index).
        Slow: call it outside the pool's lock."""
        return self.reuse.embed(tokens)

    def shareable(self, blocks: list[int]) -> int:
        """How many of `blocks`, from the first, are indexed: what a later request may inherit."""
        with self.locked():
            return sum(1 for _ in itertools.takewhile(self.reuse.index.is_cached, blocks))

    def pin(self, blocks: list[int], tenant: str, priority: int = 0, ttl: float | None = None,
            reason: str = "explicit") -> Pin | None:
        """Lock indexed `blocks` in device memory under the pin budget (see `PinRegistry.add`)."""
        with self.locked():
            return self.reuse.pins.add(blocks, tenant, priority, ttl, reason)

    def unpin(self, pin: Pin) -> None:
        """Release `pin`; its blocks stay cached. A pin released already, or another pool's,
        changes nothing."""
        with self.locked():
            self.reuse.pins.remove(pin)

    def pin_turns(self, turn_pins: TurnPins, tenant: str, tables: list[list[int]], lengths: list[int]) -> None:
        """Pin the first turns of a conversation's rows (`PagedCache(pin_turns=...)`)."""
        with self.locked():
            turn_pins.pin(self.reuse.pins, tenant, tables, lengths, self.block_size)

    def persist(self, blocks: list[int]) -> int:
        """Write indexed `blocks` to the disk tier now, from the first, stopping at the first one
        it does not keep; returns how many leading ones are on disk afterwards (0 without a disk
        tier, `has_disk_tier`)."""
        if not self.has_disk_tier:
            return 0
        with self.locked():
            metas = [self.reuse.index.metas[block] for block in blocks]
            for meta, block in zip(metas, blocks):
                if not self.tiers.write_to_disk(meta, self.block_layers(block)):
                    break
            return next((i for i, meta in enumerate(metas) if not self.tiers.disk.contains(meta.digest)), len(metas))

    def pinned_blocks(self, besides: str | None = None) -> set[int]:
        """The blocks pins hold, but for the pins of reason `besides` ("hot": the automatic ones)."""
        with self.locked():
            return self.reuse.pins.pinned_blocks(besides)

    def unpin_hot(self) -> None:
        """Drop the automatic (hot-spot) pins for good: they are a cache policy, and give way to a
        request that could not fit beside them."""
        with self.locked():
            self.reuse.pins.forget(lambda pin, blocks: pin.reason == "hot")

    def tuning(self) -> dict[str, float | None]:
        """The settings the load controller moves under pressure, as they are now: `pin_budget`,
        `hot_threshold`, `half_life` (`options` keeps the values the pool was built with)."""
        with self.locked():
            pins = self.reuse.pins
            return {"pin_budget": pins.budget, "hot_threshold": pins.hot_threshold,
                    "half_life": self.policy.half_life}

    def tune(self, pin_budget: float | None = None, hot_threshold: float | None = None,
             half_life: float | None = None) -> None:
        """Change the settings given, under the pool's lock: a lower pin budget makes the pins
        beyond it give way (they come back when it grows again, see `reuse.pins`); a shorter
        half-life makes cold prefixes leave sooner.

            pool.tune(pin_budget=0.1, half_life=60.0)
        """
        with self.locked():
            pins = self.reuse.pins
            # every value checked before any changes: a refused call changes nothing
            check_settings(pins.budget if pin_budget is None else pin_budget,
                           pins.hot_threshold if hot_threshold is None else hot_threshold)
            if half_life is not None and not half_life > 0:
                raise ValueError(f"half_life must be > 0 seconds, got {half_life}")
            if hot_threshold is not None:
                pins.hot_threshold = hot_threshold
            if pin_budget is not None:
                pins.set_budget(pin_budget)
            if half_life is not None:
                self.policy.half_life = half_life

    def referenced(self, blocks) -> int:
        """How many of `blocks` something references (inheriting those spares a block each)."""
        return self.allocator.referenced(blocks)

    @property
    def has_host_tier(self) -> bool:
        return self.tiers.host is not None

    @property
    def has_disk_tier(self) -> bool:
        return self.tiers.disk is not None

    @property
    def has_lower_tiers(self) -> bool:
        return not self.tiers.empty

    def promote(self, digest: bytes, model: str, after: int | None = None) -> tuple[int, BlockMeta, str] | None:
        """Bring `digest` back from a lower tier into a fresh referenced device block, after `after`
        if free. From the host tier its copy is queued: under an outer `locked()`, `settle` before
        reading the block (the reuse walks do; letting the lock go does too)."""
        return promotion.promote(self, digest, model, after)

    def settle(self) -> None:
        """Do the queued promotions' copies, in one batch (see `promotion.settle`)."""
        with self._lock:
            promotion.settle(self)

    def clear_tenant(self, tenant: str) -> int:
        """Forget every cached prefix, semantic entry, pin and lower-tier copy of `tenant` (blocks
        in use stay with their caches but are no longer shared); returns how many device blocks
        were freed."""
        with self.locked():
            before = self.allocator.num_free
            self.reuse.forget(tenant=tenant)
            self.tiers.forget(tenant=tenant)
            return self.allocator.num_free - before

    def change_model(self, old: str, new: str) -> None:
        """The weights with fingerprint `old` became `new`: forget what `old` computed (see
        `TierChain.change_model` for its disk files) and serve `new`'s files."""
        with self.locked():
            self.reuse.forget(model=old)
            self.tiers.change_model(old, new)

    # -------------------------------------------------------------------- stats
    def audit(self) -> dict[str, int]:
        """Check the block bookkeeping; raises PagedKVError on any inconsistency, else returns
        the counts. Once every request has finished, `references` equals the references of
        pins and semantic entries: anything more is a leak."""
        with self.locked():
            problems = self.allocator.problems(set(self.reuse.index.metas)) | self.reuse.index.problems()
            if problems:
                raise PagedKVError(f"KVPool bookkeeping is inconsistent: {problems}")
            a = self.allocator
            return {"blocks_free": a.num_free, "blocks_cached": a.idle_cached(), "blocks_in_use": a.in_use(),
                    "references": int(a.refcount.sum())} | self.reuse.references()

    def stats(self) -> dict:
        """A snapshot: sizes, occupancy, high-water mark, reuse counters, pins and tiers."""
        if not self.is_bound:
            return {"block_size": self.block_size, "num_blocks": 0}
        with self.locked():
            cached = self.allocator.idle_cached()
            used = self.num_blocks - self.allocator.num_free - cached
            per_block = self.bytes_per_block
            return self.reuse.stats() | self.tiers.stats() | {
                "block_size": self.block_size,
                "num_blocks": self.num_blocks,
                "blocks_free": self.allocator.num_free,
                "blocks_used": used,
                "blocks_cached": cached,
                "blocks_used_high_water": self.allocator.high_water,
                "bytes_per_block": per_block,
                "bytes_total": self.num_blocks * per_block,
                "bytes_used": used * per_block,
                "tokens_stored": int(self.allocator.fill.sum()),
            }

    def __repr__(self) -> str:
        if not self.is_bound:
            return f"KVPool(block_size={self.block_size}, unbound)"
        return (f"KVPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.allocator.num_free}, layers={len(self.layers)}, dtype={self.dtype})")


HUGE_PAGE = 2 << 20


def block_tensors(layout: list[tuple[tuple, torch.device]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed block tensors, one per `(shape, device)` (attention may read stale slots under a
    mask, and 0 * NaN is NaN). Under Linux the CPU ones lie one after another in one anonymous
    mapping, aligned to 2 MiB and advised to use transparent huge pages. Attention reads a KV
    head's keys at the pool's token stride (`kv_heads * head_dim` elements), across `kv_heads`
    times the pages of head-major keys, and with 4 KiB pages the TLB misses cost more than the
    reads. SmolLM2 decode on 2 cores, time per step with the pool in huge pages against the
    same pool in `torch.zeros` tensors (one process holding three models, 12 alternated blocks
    of 8 steps): batch 1 at 8192 keys bf16 67.0 / 88.8 ms, fp32 0.65x; batch 1 at 2048 bf16
    51.5 / 57.0 ms; 8 rows of 2048 fp32 0.70x. bench_decode, which holds two models, moved less:
    bf16 8192 x 1 from 1.02x-1.06x of DynamicCache to 0.95x, fp32 8192 x 1 from 0.74x to 0.72x.
    The memory is written here, so the pool's size is committed at bind, as with `torch.zeros`."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, _ in layout]
    on_cpu = [torch.device(device).type == "cpu" for _, device in layout]
    total = sum(size for size, cpu in zip(sizes, on_cpu) if cpu)
    region = _huge_page_region(total) if hasattr(mmap, "MADV_HUGEPAGE") and total else None
    tensors, offset = [], 0
    for (shape, device), size, cpu in zip(layout, sizes, on_cpu):
        if cpu and region is not None:
            tensors.append(region[offset : offset + size].view(dtype).view(shape).zero_())
            offset += size
        else:
            tensors.append(torch.zeros(shape, dtype=dtype, device=device))
    return tensors


def _huge_page_region(nbytes: int) -> torch.Tensor:
    """`nbytes` of private anonymous memory starting on a 2 MiB boundary, advised to use
    transparent huge pages (a kernel without them gives ordinary pages); uint8."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # kept alive by the tensor
    start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:
        pass
    return torch.frombuffer(mapping, dtype=torch.uint8, offset=start, count=nbytes)
