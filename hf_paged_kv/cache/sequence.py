"""Sequence: one row of KV in the pool – its block table and what the blocks hold.

A row of a `generate` batch and a request of the serving engine are both a Sequence. It knows
nothing of the pool: allocating, sharing and freeing its blocks is the caller's job (the block
ids it drops are returned so the caller can release them).

Two lengths matter. The *stored* length counts the tokens whose K/V are in the blocks (pad
tokens never are). The *logical* length counts every position transformers has seen, pads
included; `history` has one byte per logical position, 1 where a token was stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sequence:
    blocks: list[int] = field(default_factory=list)  # block table: block i holds stored tokens [i*size, (i+1)*size)
    length: int = 0  # stored tokens
    # id of each stored token; -1 where the ids alone do not name its KV (only its embedding was
    # known, the caller's own positions, other per-token inputs, or tokens it attended to were hidden since)
    tokens: list[int] = field(default_factory=list)
    history: bytearray = field(default_factory=bytearray)  # per logical position: 1 stored, 0 pad
    digests: list[bytes] = field(default_factory=list)  # chained digests of the leading blocks indexed for reuse
    gap: bool = field(init=False, default=False)  # a pad follows a stored token in `history` (see `gapped`)

    def __post_init__(self):
        self._find_gap()

    def _find_gap(self) -> None:
        history = np.frombuffer(bytes(self.history), dtype=np.uint8)
        stored = np.flatnonzero(history)
        self.gap = bool(len(stored)) and not history[stored[0] :].all()

    @property
    def logical_length(self) -> int:
        return len(self.history)

    def copy(self) -> "Sequence":
        """A sequence with the same content and the same block ids (the caller adds the references)."""
        return Sequence(list(self.blocks), self.length, list(self.tokens), bytearray(self.history), list(self.digests))

    def blocks_needed(self, count: int, block_size: int) -> int:
        """New blocks to hold `count` more stored tokens."""
        return -(-(self.length + count) // block_size) - len(self.blocks)

    def partial_block(self, block_size: int) -> int | None:
        """The last block if it is partly filled (the next token goes into it), else None."""
        return self.blocks[self.length // block_size] if self.length % block_size else None

    def append(self, real: np.ndarray, stored_ids: np.ndarray) -> None:
        """Record a finished forward: `real` marks its stored positions (bool per logical
        position), `stored_ids` the ids of the tokens it stored (-1 where unknown)."""
        self.gap = self.gapped(real)
        self.history.extend(real.astype(np.uint8).tobytes())
        self.tokens.extend(stored_ids.tolist())
        self.length += len(stored_ids)

    def truncate(self, length: int, block_size: int) -> list[int]:
        """Keep the first `length` stored tokens; returns the block ids no longer needed."""
        del self.tokens[length:]
        del self.digests[length // block_size :]
        keep = -(-length // block_size)
        dropped = self.blocks[keep:]
        del self.blocks[keep:]
        self.length = length
        return dropped

    def crop(self, logical: int, block_size: int) -> list[int]:
        """Keep the first `logical` positions (pads included); returns the block ids dropped."""
        stored = sum(self.history[:logical])
        del self.history[logical:]
        self._find_gap()
        return self.truncate(stored, block_size)

    def unstore(self, logical: np.ndarray, keep: int, block_size: int) -> list[int]:
        """Turn the stored tokens at `logical` positions into pads and keep only the first `keep`
        stored tokens (block-aligned; the caller stores the rest again); returns the block ids dropped."""
        history = np.frombuffer(bytes(self.history), dtype=np.uint8).copy()
        history[logical] = 0
        self.history = bytearray(history.tobytes())
        self._find_gap()
        return self.truncate(keep, block_size)

    def logical_positions(self) -> np.ndarray:
        """Logical position of every stored token."""
        return np.flatnonzero(np.frombuffer(bytes(self.history), dtype=np.uint8))

    def shareable_length(self) -> int:
        """Stored tokens before the first pad that follows a stored token (all of them without
        one). Only these may be shared with other requests: a sliding window counts logical
        positions, so from the first gap on the K/V of later layers depend on where the pads
        were, which no token hash says."""
        if not self.gap:
            return self.length
        history = np.frombuffer(bytes(self.history), dtype=np.uint8)
        first = int(history.argmax())
        return int(np.argmin(history[first:])) if not history[first:].all() else self.length

    def gapped(self, real: np.ndarray) -> bool:
        """Whether a pad position follows a stored token once `real` (the stored columns of a
        forward) is appended: right padding, masks with holes. Then stored and logical positions
        no longer differ by a constant, and sliding windows need the logical ones."""
        if self.gap or not len(real):
            return self.gap
        if 1 in self.history:  # a token is stored already: any pad in this forward follows it
            return not real.all()
        first = int(real.argmax()) if real.any() else len(real)
        return not real[first:].all()
