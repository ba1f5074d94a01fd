"""Per-forward metadata shared by the cache (which writes KV) and the attention backend (which reads it).

transformers calls `cache.update(k, v, layer_idx)` and then the attention function, which does
not receive the cache. The forward pre-hook builds one `StepPlan` per forward; `update` makes it
the active plan of the calling thread, and the attention function picks it up from there.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .pool import KVPool

_local = threading.local()


@dataclass
class StepPlan:
    """Everything one forward needs to write and read paged KV, built once for all layers.

    Shapes: `B` rows, `T` new positions per row (padding included).
    - `write_src` / `write_dst`: flat index into the `B*T` new tokens and the pool slot each real
      token goes to (`block * block_size + offset`); pad tokens and rows that share another row's
      prompt have no entry. `slot_mapping` `[B, T]` says the same with -1 for "no write".
    - `block_tables`: int32 `[B, max_blocks]`, -1 past each row's blocks.
    - `kv_lens`: int32 `[B]`, physical tokens per row after this forward.
    - `q_pos`: int64 `[B, T]`, physical position of each query; pad queries get 0 (they attend to
      the first key only, so their garbage output stays finite and is never read).
    """

    pool: KVPool
    write_src: torch.Tensor
    write_dst: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    q_pos: torch.Tensor
    max_kv_len: int
    uniform: bool  # every row real at every position and of the same length: no mask needed
    skip: int = 0  # leading input columns the forward may drop: every row has them cached or padded
    backend: str = "torch"  # set by the model's hook: which kernels read this plan
    memo: dict = field(default_factory=dict)  # per-device copies and backend scratch

    def on(self, name: str, device: torch.device) -> torch.Tensor:
        """`getattr(self, name)` moved to `device`, copied once per forward."""
        key = (name, device)
        if key not in self.memo:
            self.memo[key] = getattr(self, name).to(device, non_blocking=True)
        return self.memo[key]


def set_active(plan: StepPlan | None) -> None:
    _local.plan = plan


def active() -> StepPlan | None:
    return getattr(_local, "plan", None)
