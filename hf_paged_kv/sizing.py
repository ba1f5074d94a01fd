"""How many blocks a pool gets, and whether the devices can hold them – decided before any tensor
is allocated, so an impossible size is a clear error instead of a raw allocator failure."""

from __future__ import annotations

import os

import torch

from .errors import PagedKVError

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
        count = options["max_bytes"] // per_block
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
    cpu = torch.device("cpu")
    for device in {s.device for s in layers}:
        needed = num_blocks * block_bytes([s for s in layers if s.device == device], block_size, dtype)
        available = available_bytes(device)
        if needed > available:
            raise PagedKVError(
                f"a KVPool of {num_blocks} blocks of {block_size} tokens needs {needed:,} bytes on {device}, "
                f"but only {available:,} are available; give KVPool a smaller num_blocks, max_bytes or "
                "memory_fraction"
            )
    if host_blocks:
        on_cpu = num_blocks * block_bytes([s for s in layers if s.device == cpu], block_size, dtype)
        needed, available = host_blocks * block_bytes(layers, block_size, dtype), available_bytes(cpu) - on_cpu
        if needed > available:
            raise PagedKVError(
                f"a host tier of {host_blocks} blocks of {block_size} tokens needs {needed:,} bytes of host memory, "
                f"but only {max(available, 0):,} are available beside the pool; give KVPool a smaller host_blocks"
            )


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
