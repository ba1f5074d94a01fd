"""What of a waiting request's tokens the pool already holds, found without claiming anything.

The scheduler asks this for every waiting request at every step: how many of its tokens are cached
on the device (its turn in the queue), which blocks inheriting its prefix would store and where
they are (the memory rule, pins), and the digests of the blocks it will compute (the
requests that share them wait for it). Nothing is referenced, touched or moved; callers hold
the pool's lock.
"""

from __future__ import annotations

from ..pool import KVPool
from .request import Request


class PrefixProbe:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.model: str | None = None  # fingerprint of the weights, as admission last took it
        self.digests: dict[int, tuple[tuple, list]] = {}  # request id -> (what it hashed, its digest pairs)

    def keep_only(self, requests: list[Request]) -> None:
        """Forget the digests of requests other than these (they left the queue)."""
        self.digests = {r.id: self.digests[r.id] for r in requests if r.id in self.digests}

    def uncached(self, request: Request) -> int:
        """Tokens of the request that its prefill computes now: those past the cached blocks of the
        device pool (its own or published) that inheriting takes, which stop before the block
        holding its last token (that one is computed even when cached: it gives the logits)."""
        tokens = request.tokens()
        cached = self.pool.probe(self.model, request.tenant, tokens, self.chain_pairs(request), lower_tiers=False)
        return len(tokens) - cached["device"]

    def stored(self, request: Request) -> tuple[list[int], int]:
        """`(device blocks, tokens)` of the cached prefix that inheriting would store: its blocks in
        any tier up to the block before the request's last token, and of those the ones in the
        device pool."""
        return self.pool.stored_prefix(self.chain_pairs(request))

    def pairs(self, request: Request) -> list[tuple[bytes, bytes]]:
        """The digests of the request's full blocks, its tenant's and the published ones, hashed
        once per request and length (every step orders the whole queue: hashing a 1000-token
        prompt takes about 90 us)."""
        tokens = request.tokens()
        key = (len(tokens), self.model, request.tenant)
        kept = self.digests.get(request.id)
        if kept is None or kept[0] != key:
            pairs = self.pool.digest_pairs(self.model, request.tenant, tokens, len(tokens) // self.pool.block_size)
            kept = self.digests[request.id] = key, pairs
        return kept[1]

    def chain_pairs(self, request: Request) -> list[tuple[bytes, bytes]]:
        """The digest pairs of the request's full blocks before its last token."""
        return self.pairs(request)[: (len(request.tokens()) - 1) // self.pool.block_size]

    def chain(self, request: Request) -> list[bytes]:
        """The tenant's digests of the request's full blocks before its last token."""
        return [own for own, _ in self.chain_pairs(request)]
