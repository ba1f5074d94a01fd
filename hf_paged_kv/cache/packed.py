"""A packed forward: several sequences' next tokens concatenated into one row `[1, N]`, each at
its own positions (restarting per sequence), as transformers' continuous batching runs its
models. No padding is computed. The serving engine runs every step this way, and a fresh
`generate` batch computes the prefixes its rows share this way before its own forward.
"""

from __future__ import annotations

import numpy as np
import torch

from ..pool import KVPool
from . import step
from .planner import plan_packed
from .sequence import Sequence


def run(forward, backend, pool: KVPool, sequences: list[Sequence], counts: list[int], ids: np.ndarray,
        device: torch.device, **model_kwargs):
    """Run `forward` (a model's forward) on `ids`, the next `counts[s]` tokens of each of
    `sequences` in order, whose blocks must be allocated; returns its output. The plan reaches
    the attention layers through `step.activate`; PagedKVError if a layer did not write its K/V."""
    plan = plan_packed(sequences, counts, pool.block_size)
    with pool.locked():
        pool.mark_written(plan.slot_mapping)
    positions = plan.q_pos  # stored positions, the sequence's length onwards
    with step.activate(plan, backend) as active:
        output = forward(input_ids=step.to_device(ids, device)[None], position_ids=step.to_device(positions, device)[None],
                         use_cache=False, **model_kwargs)
    active.check_written(len(pool.layers))
    return output
