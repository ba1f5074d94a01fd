"""How many blocks a pool gets, and whether the devices can hold them – decided before any tensor
is allocated, so an impossible size is a clear error instead of a raw allocator failure."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..errors import PagedKVError

DEFAULT_CPU_BYTES = 1 << 30  # 1 GiB of KV when every layer sits on the CPU
DEFAULT_DEVICE_FRACTION = 0.5  # of the free memory of each accelerator holding layers


def check_options(block_size: int, options: dict) -> None:
    """KVPool's arguments, checked at construction."""
    num_blocks, max_bytes, memory_fraction = options["num_blocks"], options["max_bytes"], options["memory_fraction"]
    if sum(x is not None for x in (num_blocks, max_bytes, memory_fraction)) > 1:
        raise ValueError("give at most one of num_blocks, max_bytes and memory_fraction")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
        raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    if memory_fraction is not None and not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if options["host_blocks"] is not None and options["host_blocks"] < 1:
        raise ValueError(f"host_blocks must be >= 1, got {options['host_blocks']}")
    if options["disk_dir"] is not None and options["disk_bytes"] < 1:
        raise ValueError(f"disk_bytes must be >= 1, got {options['disk_bytes']}")


def block_bytes(layers, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block (K and V) summed over `layers`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * s.num_kv_heads * s.head_dim * itemsize for s in layers)


def choose_num_blocks(options: dict, layers, block_size: int, dtype: torch.dtype) -> int:
    per_block = block_bytes(layers, block_size, dtype)
    if options["num_blocks"] is not None:
        return options["num_blocks"]
    fraction = options["memory_fraction"]
    accelerators = {s.device for s in layers if s.device.type != "cpu"}
    if options["max_bytes"] is not None:
        count = int(options["max_bytes"]) // per_block  # 2e9 is a fine way to write it
        if count < 1:  # a bad value, where the memory left on a device (below) is the machine's state
            raise ValueError(f"max_bytes={options['max_bytes']} holds no block of {per_block} bytes; raise it or "
                             "lower block_size")
    elif not accelerators:
        budget = DEFAULT_CPU_BYTES if fraction is None else int(fraction * available_bytes(torch.device("cpu")))
        count = budget // per_block
    else:
        fraction = fraction or DEFAULT_DEVICE_FRACTION
        count = min(int(available_bytes(d) * fraction) // block_bytes([s for s in layers if s.device == d], block_size,
                                                                       dtype)
                    for d in accelerators)
    if count < 1:
        raise PagedKVError(f"the memory budget holds no block of {per_block} bytes; raise it or lower block_size")
    return count


def check_fits(layers, num_blocks: int, block_size: int, dtype: torch.dtype, host_blocks: int | None = None) -> None:
    """Refuse a pool that a device cannot hold, or a host tier that host memory cannot hold
    beside the pool's blocks there, naming the bytes needed and available."""
    pool_bytes = {device: num_blocks * block_bytes([s for s in layers if s.device == device], block_size, dtype)
                  for device in {s.device for s in layers}}
    for device, needed in pool_bytes.items():
        available = available_bytes(device)
        if needed > available:
            raise PagedKVError(
                f"a KVPool of {num_blocks} blocks of {block_size} tokens needs {needed:,} bytes on {device}, "
                f"but only {available:,} are available; give KVPool a smaller num_blocks, max_bytes or "
                "memory_fraction"
            )
    if host_blocks:
        cpu = torch.device("cpu")
        needed = host_blocks * block_bytes(layers, block_size, dtype)
        available = available_bytes(cpu) - pool_bytes.get(cpu, 0)
        if needed > available:
            raise PagedKVError(
                f"a host tier of {host_blocks} blocks of {block_size} tokens needs {needed:,} bytes of host memory, "
                f"but only {max(available, 0):,} are available beside the pool; give KVPool a smaller host_blocks"
            )


def available_bytes(device: torch.device) -> int:
    """Free bytes on `device`; on the host, the tighter of the machine's available memory and
    what the process's memory cgroup still allows (a container sees the machine's meminfo)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        machine = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    allowed = cgroup_headroom()
    return machine if allowed is None else min(machine, allowed)


# per cgroup version: (limit file, usage file, memory.stat keys of the file cache it can reclaim)
_CGROUP_FILES = {2: ("memory.max", "memory.current", ("active_file", "inactive_file")),
                 1: ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file", "total_inactive_file"))}


def cgroup_headroom(cgroups: str = "/proc/self/cgroup", mounts: str = "/proc/self/mountinfo") -> int | None:
    """Bytes the memory cgroups of this process still allow: the tightest of its own cgroup and
    the ancestors visible under the cgroup mount (v1 or v2, found in `mounts`), each its limit
    less the usage that is not file cache (the kernel reclaims file cache before it refuses
    memory, as MemAvailable counts it). None when no level sets a limit, or without cgroups."""
    try:
        memberships = _memberships(Path(cgroups).read_text())
        mount_lines = Path(mounts).read_text().splitlines()
    except (OSError, ValueError):  # no such files, or not text
        return None
    headrooms = []
    for version, root, mount_point in _memory_mounts(mount_lines):
        path = memberships.get(version)
        if path is None:
            continue
        inside = path[len(root):] if root == "/" or path == root or path.startswith(root + "/") else ""
        parts = [p for p in inside.split("/") if p]  # only the mount point where the path lies outside it
        for depth in range(len(parts) + 1):
            headroom = _headroom(Path(mount_point).joinpath(*parts[:depth]), *_CGROUP_FILES[version])
            if headroom is not None:
                headrooms.append(headroom)
    return min(headrooms, default=None)


def _memberships(text: str) -> dict[int, str]:
    """`{version: cgroup path}` of the memory controller, from /proc/self/cgroup."""
    found = {}
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and controllers == "":
            found[2] = path
        elif "memory" in controllers.split(","):
            found[1] = path
    return found


def _memory_mounts(lines: list[str]):
    """`(version, cgroup path of the mount's root, mount point)` of each memory cgroup mount in
    /proc/self/mountinfo lines (fields after " - ": file system type, source, super options)."""
    for line in lines:
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        tail = fields[fields.index("-") + 1:] + ["", "", ""]
        kind, options = tail[0], tail[2]
        root, mount_point = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f) for f in fields[3:5])
        root = root.rstrip("/") or "/"
        if kind == "cgroup2":
            yield 2, root, mount_point
        elif kind == "cgroup" and "memory" in options.split(","):
            yield 1, root, mount_point


def _headroom(directory: Path, limit_file: str, usage_file: str, cache_keys: tuple[str, ...]) -> int | None:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max":
            return None
        limit, usage = int(limit_text), int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return None
    if limit >= 1 << 60:  # v1 writes "no limit" as a page-rounded 2^63
        return None
    try:
        stat = dict(line.split(None, 1) for line in (directory / "memory.stat").read_text().splitlines())
        cache = sum(int(stat.get(key, 0)) for key in cache_keys)
    except (OSError, ValueError):
        cache = 0
    return max(limit - (usage - cache), 0)
