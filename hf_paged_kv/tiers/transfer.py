"""Batched copies of whole blocks between the device pool and host memory.

A block is one row of every layer's key and value tensor. Copying n blocks one `copy_` per row
costs n x tensors operations: a promotion of 256 blocks of a 30-layer model made 15,360 copies
of ~10 us each of host time, and demotion made as many device-to-host copies, each a stream
sync on CUDA. Here a call moves any number of rows of one tensor with a fixed number of
operations: a gather into a staging buffer, one copy between host and device, a scatter. Rows
that form one ascending run are a view of the tensor, so their gather or scatter is left out: a
prefix promoted from consecutive slots into consecutive blocks (the allocator keeps a prefix
contiguous where it can) is one copy per tensor.

Host staging buffers for a GPU are page-locked (`pin_memory`), taken from torch's caching host
allocator: a buffer freed while an asynchronous copy still reads it is not handed out again
before that copy is done (torch records the copy's stream for it), so no call here keeps one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

CHUNK_BYTES = 256 << 20  # staging held by one batch; a larger burst moves in several batches


def chunks(items: Sequence, block_bytes: int) -> Iterator[Sequence]:
    """`items` (one per block) in batches of at most `CHUNK_BYTES` of blocks."""
    size = max(1, CHUNK_BYTES // max(block_bytes, 1))
    for start in range(0, len(items), size):
        yield items[start : start + size]


def run_of(ids: Sequence[int]) -> slice | None:
    """`ids` as a slice when they are consecutive and ascending (one view of the rows), else None."""
    first = ids[0]
    return slice(first, first + len(ids)) if list(ids) == list(range(first, first + len(ids))) else None


def index_on(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """`ids` as an int64 tensor on `device`; to a GPU through page-locked memory, without a sync."""
    ids = torch.tensor(list(ids), dtype=torch.int64)
    return ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids


def gather(tensor: torch.Tensor, ids: Sequence[int], pin: bool = False) -> torch.Tensor:
    """Rows `ids` of `tensor`: a view for a run, else one `index_select` into a new buffer (on the
    host page-locked when `pin`)."""
    run = run_of(ids)
    if run is not None:
        return tensor[run]
    out = torch.empty((len(ids), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device,
                      pin_memory=pin and tensor.device.type == "cpu")
    return torch.index_select(tensor, 0, index_on(ids, tensor.device), out=out)


def scatter(tensor: torch.Tensor, ids: Sequence[int], rows: torch.Tensor) -> None:
    """Write `rows` (on any device; page-locked when on the host and `tensor` is on a GPU) into
    rows `ids` of `tensor`: one copy for a run, else one copy to `tensor`'s device and one
    `index_copy_` there. Asynchronous on a GPU, on the current stream."""
    run = run_of(ids)
    if run is not None:
        tensor[run].copy_(rows, non_blocking=True)
    else:
        tensor.index_copy_(0, index_on(ids, tensor.device), rows.to(tensor.device, non_blocking=True))


def to_host(tensors: list[torch.Tensor], blocks: Sequence[int]) -> list[torch.Tensor]:
    """Rows `blocks` of each of `tensors`, on the host (`[len(blocks), *row]` each; views of a CPU
    tensor's run, valid until its blocks are written again). A GPU tensor's rows are gathered and
    copied on its device's current stream, after the kernels queued before (which may still
    write them), and the call returns once all of them are here: one wait for the whole batch."""
    out, devices = [], set()
    for tensor in tensors:
        rows = gather(tensor, blocks)
        if tensor.device.type == "cuda":
            staged = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            staged.copy_(rows, non_blocking=True)
            rows = staged
            devices.add(tensor.device)
        out.append(rows)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return out


def to_device(sources: list[torch.Tensor], slots: Sequence[int], targets: list[torch.Tensor],
              blocks: Sequence[int]) -> None:
    """Copy rows `slots` of each host tensor in `sources` into rows `blocks` of the matching tensor
    in `targets`: per tensor a gather here (into page-locked staging for a GPU), one copy, a
    scatter there, queued on the current stream (the caller picks it; synchronous on the CPU)."""
    for source, target in zip(sources, targets):
        scatter(target, blocks, gather(source, slots, pin=target.device.type == "cuda"))


def block_of(rows: list[torch.Tensor], i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Block `i` of a `to_host` batch of keys-then-values tensors, as `(key, value)` per layer."""
    layers = len(rows) // 2
    return [(rows[j][i], rows[layers + j][i]) for j in range(layers)]
