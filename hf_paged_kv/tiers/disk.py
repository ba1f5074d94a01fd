"""Disk tier: cached blocks as files, so a restarted process reuses the KV of known prefixes.

    >>> pool = KVPool(num_blocks=4096, host_blocks=16384, disk_dir="/var/cache/kv", disk_bytes=20 << 30)
    >>> hf_paged_kv.persist(model, system_prompt, tokenizer)   # write a prefix now, explicitly

Blocks reach the disk when they fall out of the host tier (or out of the device pool when there
is no host tier), or by `persist`. One file per block, named by its digest: a JSON header (format
tag, model fingerprint, digest, tenant, depth, fill, access weight and time, layer shapes and
dtype, BLAKE2b checksum of the payload) and the payload, the block's K and V of every layer.
Files are written to a temporary name and renamed, so a crash never leaves a half-written block
under a real name. A file whose format, fingerprint, digest, shapes or checksum do not match is
ignored with a warning (never loaded) and counted in `disk_rejects`. Digests already include
the tenant, so a tenant can only ever find its own (or published) blocks.

The directory has a byte budget; when a write exceeds it, the files of lowest value go first
(the same value as in memory, with wall-clock times, which survive restarts).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..reuse.prefix_index import block_value

FORMAT = "hf_paged_kv-block/1"
SUFFIX = ".kvblock"


@dataclass
class DiskEntry:
    path: Path
    size: int
    tenant: str
    depth: int
    weight: float
    last_access: float  # wall-clock seconds
    priority: int = 0


class DiskTier:
    """A directory of block files with an in-memory catalogue. Calls happen under the pool's lock."""

    def __init__(self, pool, directory, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"disk_bytes must be >= 1, got {max_bytes}")
        self.pool = pool
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.counters = dict.fromkeys(("disk_writes", "disk_hits", "disk_rejects", "disk_drops"), 0)
        self.catalog: dict[bytes, DiskEntry] = {}
        for path in self.directory.glob("*" + SUFFIX):
            header = self._read_header(path)
            if header is not None:
                self.catalog[bytes.fromhex(header["digest"])] = DiskEntry(
                    path, path.stat().st_size, header["tenant"], header["depth"], header["weight"],
                    header["last_access"], header.get("priority", 0))

    # --------------------------------------------------------------- write
    def write(self, digest: bytes, tenant: str, depth: int, weight: float, fill: int, layers,
              priority: int = 0) -> None:
        """Store one block given as `(key, value)` CPU or device tensors per layer."""
        if digest in self.catalog:
            return
        payload = b"".join(t.detach().cpu().contiguous().numpy().tobytes() for pair in layers for t in pair)
        header = {
            "format": FORMAT, "fingerprint": self.pool.fingerprint, "digest": digest.hex(), "tenant": tenant,
            "depth": depth, "fill": fill, "weight": weight, "last_access": time.time(), "priority": priority,
            "shapes": [list(t.shape) for pair in layers for t in pair], "dtype": str(self.pool.dtype),
            "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest(),
        }
        raw = json.dumps(header).encode()
        path = self.directory / (digest.hex() + SUFFIX)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        with open(partial, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw + payload)
        os.replace(partial, path)
        self.catalog[digest] = DiskEntry(path, path.stat().st_size, tenant, depth, weight, header["last_access"],
                                         priority)
        self.counters["disk_writes"] += 1
        self._enforce_budget(keep=digest)

    # ---------------------------------------------------------------- read
    def contains(self, digest: bytes) -> bool:
        return digest in self.catalog

    def load(self, digest: bytes, block: int) -> DiskEntry | None:
        """Copy the file of `digest` into device `block`; None (with a warning) if it fails checks."""
        entry = self.catalog.get(digest)
        if entry is None:
            return None
        try:
            data = entry.path.read_bytes()
            size = int.from_bytes(data[:8], "little")
            header = json.loads(data[8 : 8 + size])
            payload = data[8 + size :]
            self._check(header, digest, payload, entry.path)
        except (OSError, ValueError, KeyError) as error:
            self._reject(digest, f"{entry.path.name}: {error}")
            return None
        offset = 0
        for device in (t for pair in zip(self.pool.key_cache, self.pool.value_cache) for t in pair):
            target = device[block]
            count = target.numel() * target.element_size()
            array = np.frombuffer(payload, dtype=np.uint8, count=count, offset=offset)
            target.copy_(torch.from_numpy(array.copy()).view(target.dtype).view(target.shape))
            offset += count
        self.pool.fill[block] = header["fill"]
        entry.last_access = time.time()
        self.counters["disk_hits"] += 1
        return entry

    def used_bytes(self) -> int:
        return sum(e.size for e in self.catalog.values())

    # ------------------------------------------------------------- helpers
    def _check(self, header: dict, digest: bytes, payload: bytes, path: Path) -> None:
        if header.get("format") != FORMAT:
            raise ValueError(f"unknown format {header.get('format')!r}")
        if header["fingerprint"] != self.pool.fingerprint:
            raise ValueError("written by another model (fingerprint differs)")
        if header["digest"] != digest.hex():
            raise ValueError("digest in the header does not match the file name")
        expected = [[self.pool.block_size, s.num_kv_heads, s.head_dim] for s in self.pool.layers for _ in range(2)]
        if header["shapes"] != expected or header["dtype"] != str(self.pool.dtype):
            raise ValueError("block shapes or dtype differ from this pool")
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["checksum"]:
            raise ValueError("checksum mismatch (corrupted or truncated)")

    def _read_header(self, path: Path) -> dict | None:
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            if header.get("format") != FORMAT:
                raise ValueError(f"unknown format {header.get('format')!r}")
            if header.get("fingerprint") != self.pool.fingerprint:
                raise ValueError("written by another model (fingerprint differs)")
            return header
        except (OSError, ValueError) as error:
            warnings.warn(f"hf_paged_kv disk tier: ignoring unreadable {path.name}: {error}", stacklevel=2)
            self.counters["disk_rejects"] += 1
            return None

    def _reject(self, digest: bytes, why: str) -> None:
        warnings.warn(f"hf_paged_kv disk tier: ignoring {why}", stacklevel=3)
        self.counters["disk_rejects"] += 1
        self.catalog.pop(digest, None)

    def _enforce_budget(self, keep: bytes) -> None:
        now, half_life = time.time(), self.pool.index.half_life
        while self.used_bytes() > self.max_bytes and len(self.catalog) > 1:
            victim = min((d for d in self.catalog if d != keep), key=lambda d: block_value(
                self.catalog[d].weight, self.catalog[d].last_access, self.catalog[d].depth, None, now, half_life,
                self.catalog[d].priority))
            self.catalog.pop(victim).path.unlink(missing_ok=True)
            self.counters["disk_drops"] += 1
