"""One packed forward of the serving engine.

Every scheduled sequence contributes its next tokens – one for a decode, a chunk for a prefill –
concatenated into a single row `[1, N]` with positions restarting per sequence, as transformers'
own continuous batching runs its models. No padding is computed, and prefill chunks and decodes
share the forward. The plan (`planner.plan_packed`) travels to the registered attention function
through `step.activate`; only the logits of sequences that reach their last token are computed
(`logits_to_keep` with their indices).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import step
from ..planner import plan_packed
from ..pool import KVPool
from .request import Request


def forward(model, backend, pool: KVPool, batch: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[Request]]:
    """Run `batch` (request, tokens to feed) through `model`; returns the next-token logits
    `[k, vocab]` of the k requests whose fed tokens reach their end, and those requests. The
    sequences' blocks must already be allocated; nothing is committed here."""
    sequences, counts = [r.sequence for r, _ in batch], [n for _, n in batch]
    plan = plan_packed(sequences, counts, pool.block_size)
    with pool.locked():
        pool.mark_written(plan.slot_mapping)
    ids = np.concatenate([r.tokens()[r.computed : r.computed + n] for r, n in batch])
    positions = np.concatenate([np.arange(r.computed, r.computed + n) for r, n in batch])
    sampled = [i for i, (r, n) in enumerate(batch) if r.computed + n == len(r.tokens())]
    keep = plan.q_start[1:][sampled] - 1 if sampled else np.array([len(ids) - 1])
    device = model.get_input_embeddings().weight.device
    with torch.inference_mode(), step.activate(plan, backend) as active:
        logits = model(input_ids=step.to_device(ids, device)[None], position_ids=step.to_device(positions, device)[None],
                       use_cache=False, logits_to_keep=step.to_device(keep, device)).logits[0]
    active.check_written(len(pool.layers))
    return (logits if sampled else logits[:0]), [batch[i][0] for i in sampled]


def commit(batch: list[tuple[Request, int]]) -> None:
    """The forward succeeded: its tokens are now stored in the sequences."""
    for request, count in batch:
        fed = request.tokens()[request.computed : request.computed + count]
        request.sequence.tokens.extend(fed)
        request.sequence.length += count
        request.sequence.history.extend(b"\x01" * count)
        request.computed += count
        request.reached = max(request.reached, request.computed)


def token_kinds(batch: list[tuple[Request, int]]) -> tuple[int, int]:
    """`(prompt tokens computed for the first time, tokens computed again after a preemption)` of
    a forward not yet committed; the rest are decodes (the token sampled last, fed once)."""
    first = again = 0
    for request, count in batch:
        decode = 1 if request.generated and request.computed + count == len(request.tokens()) else 0
        repeated = max(0, min(request.computed + count - decode, request.reached) - request.computed)
        first, again = first + count - decode - repeated, again + repeated
    return first, again
