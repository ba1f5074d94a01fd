"""The disk tier's file format: one block per safetensors file, self-describing and checksummed.

A file holds the block's K and V of every layer (`k.0`, `v.0`, `k.1`, ...) and string metadata:
format, model fingerprint, digest, the parent block's digest, tenant, depth, fill, decayed access
weight and wall-clock time, wall-clock expiry, priority, and a BLAKE2b checksum over the metadata
and every tensor's bytes. It is written to a temporary name and renamed, so a crash never leaves
a half-written block under a real name. `read` raises `RejectedFile` (or whatever a damaged file
makes safetensors raise) when any check fails; files of an earlier format (before
`hf_paged_kv-block/3` they did not name their parent) fail the first.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..pool.policy import BlockMeta

FORMAT = "hf_paged_kv-block/3"
SUFFIX = ".kvblock"
FIELDS = ("format", "model", "digest", "parent", "tenant", "depth", "fill", "weight", "written", "priority")


class RejectedFile(ValueError):
    """A block file failed one of the checks; the message names which (the same for every file
    that fails it, so a directory scan groups files by it)."""


def path_of(directory: Path, digest: bytes) -> Path:
    return directory / (digest.hex() + SUFFIX)


def partial_of(path: Path) -> Path:
    """Where `write` puts the file before renaming it (`.<name>.<pid>.partial`)."""
    return path.with_name(f".{path.name}.{os.getpid()}.partial")


def write(path: Path, meta: BlockMeta, layers: list[tuple[torch.Tensor, torch.Tensor]], written: float,
          expires: float | None) -> None:
    """Write one block (`(key, value)` per layer, any device); `meta`'s weight is taken as of
    `written`, both times are wall-clock. Raises OSError or SafetensorError; the partial file is
    then left for the caller to remove."""
    tensors = {f"{kind}.{i}": t.detach().to("cpu").contiguous()
               for i, pair in enumerate(layers) for kind, t in zip("kv", pair)}
    header = {"format": FORMAT, "model": meta.model, "digest": meta.digest.hex(), "parent": meta.parent.hex(),
              "tenant": meta.tenant, "depth": str(meta.depth), "fill": str(meta.fill), "weight": repr(meta.weight),
              "written": repr(written), "expires": "" if expires is None else repr(expires),
              "priority": str(meta.priority)}
    header["checksum"] = _checksum(header, tensors)
    partial = partial_of(path)
    save_file(tensors, partial, metadata=header)
    os.replace(partial, path)


def read(path: Path, model: str, block_shapes: list[tuple[int, ...]] | None = None, dtype: torch.dtype | None = None,
         digest: bytes | None = None) -> tuple[dict, dict | None]:
    """The file's header and, given `block_shapes` and `dtype`, its tensors (checked against them
    and the checksum); raises on any failed check."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        header = f.metadata() or {}
        if header.get("format") != FORMAT or not all(isinstance(header.get(k), str) for k in FIELDS):
            raise RejectedFile("not a block file of this format (fields missing or damaged)")
        if header["model"] != model:
            raise RejectedFile(f"written by another model ({_difference(header['model'], model)})")
        if path.name != header["digest"] + SUFFIX or (digest is not None and header["digest"] != digest.hex()):
            raise RejectedFile("digest in the header does not match the file name")
        if block_shapes is None:
            return header, None
        data = {name: f.get_tensor(name) for name in f.keys()}
    expected = {f"{kind}.{i}": tuple(shape) for i, shape in enumerate(block_shapes) for kind in "kv"}
    if {n: tuple(t.shape) for n, t in data.items()} != expected or any(t.dtype != dtype for t in data.values()):
        raise RejectedFile("block shapes or dtype differ from this pool")
    if header.get("checksum") != _checksum({k: v for k, v in header.items() if k != "checksum"}, data):
        raise RejectedFile("checksum mismatch (corrupted or truncated)")
    return header, data


def meta_of(header: dict, shift: float, ttl: float | None) -> BlockMeta:
    """The block record of a file's header, its wall-clock times moved by `shift` (to a policy's
    clock); with a `ttl`, the block expires at the latest a TTL after it was written."""
    written = float(header["written"]) + shift
    limits = [float(header["expires"]) + shift] if header.get("expires") else []
    if ttl is not None:
        limits.append(written + ttl)
    return BlockMeta(bytes.fromhex(header["digest"]), header["tenant"], int(header["depth"]), header["model"],
                     float(header["weight"]), written, min(limits, default=None), int(header["priority"]),
                     int(header["fill"]), bytes.fromhex(header["parent"]))


def _difference(written: str, ours: str) -> str:
    """What differs between two fingerprints: their `block_size=` or `dtype=` parts, named (a
    restart with another block size or dtype is the common case), else the weights."""
    named = {part.split("=")[0]: part for part in ours.split("|") if "=" in part}
    changed = [f"{part} where this pool has {named[key]}" for part in written.split("|") if "=" in part
               and (key := part.split("=")[0]) in named and named[key] != part]
    return "; ".join(changed) or "fingerprint differs: other weights or config"


def _checksum(header: dict, tensors: dict) -> str:
    digest = hashlib.blake2b(json.dumps(header, sort_keys=True).encode(), digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy())  # hashed in place, not copied
    return digest.hexdigest()
