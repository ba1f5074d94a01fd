"""Disk tier: cached blocks as files, so a restarted process reuses the KV of known prefixes.

    >>> pool = KVPool(num_blocks=4096, host_blocks=16384, disk_dir="/var/cache/kv", disk_bytes=20 << 30)
    >>> hf_paged_kv.persist(model, system_prompt, tokenizer)   # write a prefix now, explicitly

Blocks reach the disk when they fall out of the host tier (or out of the device pool when there
is no host tier), or by `persist`. One safetensors file per block, named by its digest: the
block's K and V of every layer, and string metadata (format, model fingerprint, digest, tenant,
depth, fill, decayed access weight and wall-clock time, priority) with a BLAKE2b checksum over
the metadata and every tensor's bytes. Files are written to a temporary name and renamed, so a
crash never leaves a half-written block under a real name. A file that fails any check – its
header does not parse, a field is missing or damaged, the shapes, dtype, model or digest differ,
the checksum does not match – is ignored with a warning (never loaded, never fatal) and counted
in `disk_rejects`. Digests include the tenant, so a tenant only ever finds its own (or
published) blocks.

A write that fails (permissions, a full or read-only file system) drops the block cleanly: the
pool stays consistent, the error is warned once and counted in `disk_write_errors`.

The directory has a byte budget; when a write exceeds it, the files of lowest value go first
(the same value as in memory, with wall-clock times, which survive restarts).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..policy import BlockMeta, Policy

FORMAT = "hf_paged_kv-block/2"
SUFFIX = ".kvblock"
FIELDS = ("format", "model", "digest", "tenant", "depth", "fill", "weight", "written", "priority")


class DiskTier:
    """A directory of block files with an in-memory catalogue. Calls happen under the pool's lock."""

    def __init__(self, directory, max_bytes: int, block_shapes: list[tuple[int, ...]], dtype: torch.dtype,
                 policy: Policy, model: str):
        self.directory = Path(directory)
        self.block_shapes, self.dtype, self.policy = [tuple(s) for s in block_shapes], dtype, policy
        self.max_bytes = max_bytes
        self.counters = dict.fromkeys(("disk_writes", "disk_hits", "disk_rejects", "disk_drops", "disk_write_errors"), 0)
        self.catalog: dict[bytes, tuple[Path, int, BlockMeta]] = {}  # digest -> (path, bytes, meta in wall time)
        self.warned_write = False
        file_bytes = 2 * sum(torch.Size(s).numel() for s in self.block_shapes) * torch.empty((), dtype=dtype).element_size()
        if max_bytes < file_bytes:
            raise ValueError(f"disk_bytes={max_bytes} cannot hold one block file of about {file_bytes} bytes; "
                             "raise disk_bytes (or leave disk_dir unset)")
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.directory.glob("*" + SUFFIX)):
            meta = self._read(path, model, tensors=False)
            if meta is not None:
                self.catalog[meta.digest] = (path, path.stat().st_size, meta)

    # ---------------------------------------------------------------- write
    def write(self, meta: BlockMeta, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Store one block (`(key, value)` per layer, any device); False if the write failed."""
        if meta.digest in self.catalog:
            return True
        now = self.policy.now()
        weight = meta.weight_at(now, self.policy.half_life)
        tensors = {f"{kind}.{i}": t.detach().to("cpu").contiguous()
                   for i, pair in enumerate(layers) for kind, t in zip("kv", pair)}
        header = {"format": FORMAT, "model": meta.model, "digest": meta.digest.hex(), "tenant": meta.tenant,
                  "depth": str(meta.depth), "fill": str(meta.fill), "weight": repr(weight),
                  "written": repr(time.time()), "priority": str(meta.priority)}
        header["checksum"] = _checksum(header, tensors)
        path = self.directory / (meta.digest.hex() + SUFFIX)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            save_file(tensors, partial, metadata=header)
            os.replace(partial, path)
        except (OSError, SafetensorError) as error:  # permissions, a full or read-only file system
            self._write_failed(partial, error)
            return False
        wall = replace(meta, weight=weight, last_access=float(header["written"]))
        self.catalog[meta.digest] = (path, path.stat().st_size, wall)
        self.counters["disk_writes"] += 1
        self._enforce_budget(keep=meta.digest)
        return True

    def _write_failed(self, partial: Path, error: Exception) -> None:
        try:
            partial.unlink(missing_ok=True)
        except OSError:
            pass  # the directory itself is unwritable: nothing was left behind
        self.counters["disk_write_errors"] += 1
        if not self.warned_write:
            self.warned_write = True
            warnings.warn(f"hf_paged_kv disk tier: cannot write to {self.directory} ({error}); blocks that would "
                          "go to disk are dropped instead (counted in disk_write_errors)", stacklevel=4)

    # ----------------------------------------------------------------- read
    def contains(self, digest: bytes) -> bool:
        return digest in self.catalog

    def load(self, digest: bytes, model: str, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> BlockMeta | None:
        """Copy the file of `digest` into a device block (`layers`: its `(key, value)` views).
        Returns the block's metadata (weight decayed to now, on the policy's clock), or None
        (with a warning) if the file fails any check."""
        entry = self.catalog.get(digest)
        if entry is None:
            return None
        path, _, _ = entry
        loaded = self._read(path, model, tensors=True, digest=digest)
        if loaded is None:
            self.catalog.pop(digest, None)
            return None
        meta, tensors = loaded
        for i, (key, value) in enumerate(layers):
            key.copy_(tensors[f"k.{i}"])
            value.copy_(tensors[f"v.{i}"])
        self.counters["disk_hits"] += 1
        age = max(0.0, time.time() - meta.last_access)
        now = self.policy.now()
        expires = None if self.policy.ttl is None else now + self.policy.ttl
        return replace(meta, weight=meta.weight * 0.5 ** (age / self.policy.half_life), last_access=now, expires=expires)

    def _read(self, path: Path, model: str, tensors: bool, digest: bytes | None = None):
        """The file's metadata (and tensors), or None after a warning when any check fails."""
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                header = f.metadata() or {}
                if header.get("format") != FORMAT or not all(isinstance(header.get(k), str) for k in FIELDS):
                    raise ValueError("not a block file of this format (fields missing or damaged)")
                if header["model"] != model:
                    raise ValueError("written by another model (fingerprint differs)")
                if path.name != header["digest"] + SUFFIX or (digest is not None and header["digest"] != digest.hex()):
                    raise ValueError("digest in the header does not match the file name")
                meta = BlockMeta(bytes.fromhex(header["digest"]), header["tenant"], int(header["depth"]), header["model"],
                                 float(header["weight"]), float(header["written"]), None, int(header["priority"]),
                                 int(header["fill"]))
                if not tensors:
                    return meta
                data = {name: f.get_tensor(name) for name in f.keys()}
            expected = {f"{kind}.{i}": shape for i, shape in enumerate(self.block_shapes) for kind in "kv"}
            if {n: tuple(t.shape) for n, t in data.items()} != expected or any(t.dtype != self.dtype for t in data.values()):
                raise ValueError("block shapes or dtype differ from this pool")
            if header.get("checksum") != _checksum({k: v for k, v in header.items() if k != "checksum"}, data):
                raise ValueError("checksum mismatch (corrupted or truncated)")
            return meta, data
        except Exception as error:  # any damage at all: skip the file, never fail the request
            warnings.warn(f"hf_paged_kv disk tier: ignoring {path.name}: {error}", stacklevel=3)
            self.counters["disk_rejects"] += 1
            return None

    # -------------------------------------------------------------- budget
    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self.catalog.values())

    def forget(self, tenant: str | None = None, model: str | None = None) -> int:
        """Delete the files of `tenant` and/or `model`."""
        doomed = [d for d, (_, _, m) in self.catalog.items()
                  if (tenant is None or m.tenant == tenant) and (model is None or m.model == model)]
        for digest in doomed:
            self.catalog.pop(digest)[0].unlink(missing_ok=True)
        return len(doomed)

    def stats(self) -> dict:
        return {"disk_blocks": len(self.catalog), "disk_bytes_used": self.used_bytes(),
                "disk_bytes_budget": self.max_bytes} | self.counters

    def _enforce_budget(self, keep: bytes) -> None:
        if self.used_bytes() <= self.max_bytes:
            return
        wall = {d: m for d, (_, _, m) in self.catalog.items() if d != keep}
        excess = self.used_bytes() - self.max_bytes

        def remove(digest: bytes) -> None:
            nonlocal excess
            path, size, _ = self.catalog.pop(digest)
            path.unlink(missing_ok=True)
            excess -= size
            self.counters["disk_drops"] += 1

        while excess > 0 and wall:
            (victim,) = self.policy.evict(wall, list(wall), 1, remove, now=time.time())
            del wall[victim]


def _checksum(header: dict, tensors: dict) -> str:
    digest = hashlib.blake2b(json.dumps(header, sort_keys=True).encode(), digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy())  # hashed in place, not copied
    return digest.hexdigest()
