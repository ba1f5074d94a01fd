"""Block size advice: which block size suits the prompts a deployment actually sees.

The block size of a live pool cannot change: every block hash, every cached prefix and every
compiled kernel variant depends on it. What can be chosen is the size the next start uses, from
the observed workload. Three costs pull in opposite directions:

- **memory lost to partial blocks**: a sequence wastes, on average, half a block at its end;
  larger blocks waste more of a pool full of short sequences;
- **reuse lost at prefix ends**: a shared prefix (system prompt, document) is reused in whole
  blocks only, so up to a block of it is recomputed by every request;
- **bookkeeping per block**: block tables, hashes, allocation and (on GPUs) kernel tiles cost
  per block; smaller blocks mean more of them.

    >>> advice = advise_block_size(prompt_lengths, shared_prefix_lengths=[600])
    >>> advice.block_size, advice.table      # the recommendation and the figures behind it
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CANDIDATES = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Advice:
    block_size: int
    table: list[dict]  # per candidate: memory waste, reuse loss, blocks per sequence, cost

    def __str__(self) -> str:
        rows = [f"{r['block_size']:>5} {r['memory_waste']:>8.1%} {r['reuse_loss']:>8.1%} "
                f"{r['blocks_per_sequence']:>8.1f} {r['cost']:>8.3f}" for r in self.table]
        return "\n".join([f"recommended block size: {self.block_size}",
                          "block  waste    reuse-loss blocks/seq cost", *rows])


def advise_block_size(lengths, shared_prefix_lengths=(), candidates=CANDIDATES, block_overhead: float = 0.05,
                      tolerance: float = 0.005) -> Advice:
    """Recommend a block size for sequences of `lengths` tokens (prompt plus generated) whose
    prompts share prefixes of `shared_prefix_lengths` tokens.

    The cost of a candidate is the share of KV memory wasted in partial blocks, plus the share
    of shared-prefix tokens recomputed because they do not fill a block, plus the bookkeeping
    per token: `block_overhead` (the work of one block's bookkeeping in units of one token's
    computation) over the block size. The largest block size within `tolerance` of the lowest
    cost wins: fewer, larger blocks are cheaper for the kernels.
    """
    lengths = np.asarray(list(lengths), dtype=np.float64)
    if not len(lengths) or (lengths < 1).any():
        raise ValueError("advise_block_size needs at least one sequence length, all >= 1")
    shared = np.asarray(list(shared_prefix_lengths), dtype=np.float64)
    table = []
    for size in candidates:
        blocks = np.ceil(lengths / size)
        waste = float((blocks * size - lengths).sum() / (blocks * size).sum())
        loss = float((shared % size).sum() / shared.sum()) if len(shared) and shared.sum() else 0.0
        per_sequence = float(blocks.mean())
        cost = waste + loss + block_overhead / size
        table.append({"block_size": size, "memory_waste": waste, "reuse_loss": loss,
                      "blocks_per_sequence": per_sequence, "cost": cost})
    best = min(r["cost"] for r in table)
    choice = max(r["block_size"] for r in table if r["cost"] <= best + tolerance)
    return Advice(choice, table)
