"""StepPlan: what one forward writes into the pool and reads from it, the same for every layer.

One plan per forward is built on the host (`planner.py`: for `generate` through `forward_plan`,
for the serving engine through `packed`). Each attention layer then calls the backend twice
with it: `write` stores the layer's new K/V at `slot_mapping`, and `attention` reads every
sequence's keys through `block_tables`. transformers' attention function
does not receive the cache, so the plan travels to it through `activate`, a per-thread context
that the integration opens around the model's forward and the serving engine around its own.

Queries are numbered in the order the model sees them, flattened: `[B, T]` row-major. Each
sequence's queries are contiguous: sequence `s` owns queries `q_start[s]:q_start[s+1]`. A
`generate` batch has one sequence per row (`q_start = 0, T, 2T, ...`); the engine packs many
sequences into one row.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import PagedKVError

_local = threading.local()


@dataclass
class StepPlan:
    """Host arrays describing one forward (converted to tensors on demand by `on`).

    - `slot_mapping` int64 `[Q]`: pool slot (`block * block_size + offset`) each query's K/V is
      written to; -1 for none (pads, tokens already stored, rows sharing another row's blocks).
    - `q_start` int64 `[S + 1]`: query offsets of each sequence.
    - `q_pos` int64 `[Q]`: the last stored position each query may see (causal, in stored
      positions); -1 for a query that sees nothing (a pad before any real token).
    - `block_tables` int32 `[S, max_blocks]`, -1 past each sequence's blocks.
    - `kv_lens` int32 `[S]`: stored tokens of each sequence after this forward.
    - `contiguous` int64 `[S]`: first block of a sequence whose keys lie in one run of
      consecutive blocks (the torch backend reads them as a view), else -1.
    - `q_logical` int64 `[Q]` / `k_logical` int64 `[S, max_kv_len]`: logical positions (pads
      counted) of queries and stored keys; only set when they are not stored positions plus a
      constant (right padding, holes), because sliding windows count logical positions.
    """

    batch_shape: tuple[int, int]
    slot_mapping: np.ndarray
    q_start: np.ndarray
    q_pos: np.ndarray
    block_tables: np.ndarray
    kv_lens: np.ndarray
    contiguous: np.ndarray
    block_size: int
    q_logical: np.ndarray | None = None
    k_logical: np.ndarray | None = None
    skip: int = 0  # leading input columns the forward drops: every row has them stored or padded
    logical_length: int = 0  # logical positions after this forward (pads counted)
    memo: dict = field(default_factory=dict)  # tensors per device, backend scratch

    @property
    def num_sequences(self) -> int:
        return len(self.kv_lens)

    @property
    def max_kv_len(self) -> int:
        return int(self.kv_lens.max()) if len(self.kv_lens) else 0

    @property
    def query_counts(self) -> np.ndarray:
        return np.diff(self.q_start)

    @property
    def decode_only(self) -> bool:
        """One query per sequence, each seeing its whole sequence (plain decoding)."""
        if "decode_only" not in self.memo:  # asked by every layer: computed once
            self.memo["decode_only"] = len(self.q_pos) == len(self.kv_lens) and bool(
                (self.q_pos == self.kv_lens.astype(np.int64) - 1).all())
        return self.memo["decode_only"]

    @property
    def single_and_chunked(self) -> tuple[np.ndarray, np.ndarray]:
        """`(single, chunked)`: the sequences with one query (decodes, attended together in a
        packed forward) and those with several (prefill chunks, attended one by one)."""
        if "single_and_chunked" not in self.memo:
            single = self.query_counts == 1
            self.memo["single_and_chunked"] = np.flatnonzero(single), np.flatnonzero(~single)
        return self.memo["single_and_chunked"]

    def on(self, name: str, device: torch.device) -> torch.Tensor:
        """Field `name` as a tensor on `device`, copied once per forward."""
        key = (name, device)
        if key not in self.memo:
            self.memo[key] = to_device(getattr(self, name), device)
        return self.memo[key]


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device`. To a GPU through page-locked memory, so the copy is
    queued on the stream and the host never waits for the GPU (pageable copies synchronize)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class Step:
    """The forward in progress on this thread: its plan, the backend that runs it, whether the
    caller asked for attention weights, and the layers that wrote their K/V so far."""

    plan: StepPlan
    backend: object
    need_weights: bool = False
    written: set = field(default_factory=set)

    def check_written(self, num_layers: int) -> None:
        """Raise unless each of the pool's `num_layers` layers wrote its K/V in this forward: one
        that ran other attention (its implementation changed after enable) left its blocks
        unwritten, and committing them would share garbage."""
        if len(self.written) != num_layers:
            raise PagedKVError(
                f"only {len(self.written)} of the model's {num_layers} attention layers ran hf_paged_kv's attention in "
                "this forward (was the attention implementation changed after hf_paged_kv.enable, e.g. by "
                "set_attn_implementation?): nothing was stored; call hf_paged_kv.disable(model) and enable it again")


@contextmanager
def activate(plan: StepPlan, backend, need_weights: bool = False):
    """Make `plan` the active plan of this thread for the duration of one forward."""
    previous = getattr(_local, "step", None)
    _local.step = Step(plan, backend, need_weights)
    try:
        yield _local.step
    finally:
        _local.step = previous


def current() -> Step | None:
    return getattr(_local, "step", None)


@contextmanager
def probing(recording):
    """While `enable` checks a model: the attention function records what it receives."""
    _local.probe = recording
    try:
        yield recording
    finally:
        _local.probe = None


def probe_recording():
    return getattr(_local, "probe", None)
