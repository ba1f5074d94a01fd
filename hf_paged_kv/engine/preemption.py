"""Sending a running request back to the queue, and giving it back its KV when it resumes.

Preemption keeps the request's full blocks cached (they are indexed as soon as they fill: it
inherits them again, from the device or, once evicted, from the host or disk tier) and either
keeps its partial last block in host memory or lets it be recomputed, whichever the measured
costs say is cheaper; a resumed request gets exactly the KV it had. A request preempted because
memory ran out gains a priority level each time (no starvation); one that yields its memory to
another's first token (`yielding`) keeps its priority and is marked `yielded` until it is back.
The host copy is labelled with the weights' fingerprint as admission last took it (the full
blocks' index entries are too): after the weights change it is dropped and the tokens computed again.
"""

from __future__ import annotations

import logging
import time

from ..pool import KVPool
from ..sequence import Sequence
from .costs import StepCosts
from .prefix_probe import PrefixProbe
from .request import Request
from .scheduler import Scheduler

log = logging.getLogger("hf_paged_kv.engine")


class Preemption:
    def __init__(self, pool: KVPool, scheduler: Scheduler, costs: StepCosts, prefixes: PrefixProbe):
        self.pool, self.scheduler, self.costs, self.prefixes = pool, scheduler, costs, prefixes
        self.copy_seconds_per_block = 0.0

    def preempt(self, request: Request, yielding: bool = False) -> str:
        """Send a running request back to the queue; returns the mode ("swap" or "recompute").
        `yielding`: it makes room for another's first token (its priority stays)."""
        sequence, size = request.sequence, self.pool.block_size
        partial = sequence.partial_block(size)
        mode = "recompute"
        # one yielding for a first token comes back soon and during a burst: no recompute then
        if partial is not None and (yielding or self._swap_is_cheaper(sequence.length % size)):
            started = time.perf_counter()
            request.swapped = (self.prefixes.model, sequence.length, [(k.to("cpu", copy=True), v.to("cpu", copy=True))
                                                 for k, v in self.pool.block_layers(partial)])
            self.copy_seconds_per_block = time.perf_counter() - started
            mode = "swap"
        self.scheduler.remove(request)
        self.pool.decref(sequence.blocks)  # full blocks were indexed: they stay cached
        request.sequence, request.computed = Sequence(), 0
        if yielding:
            request.yielded = True
        else:
            request.preemptions += 1
        self.scheduler.enqueue(request)
        log.info("preempted request %d (%s%s, %d tokens stored), its priority now %d", request.id, mode,
                 ", yielding to a first token" if yielding else "", sequence.length, request.effective_priority)
        return mode

    def _swap_is_cheaper(self, tokens: int) -> bool:
        per_token = self.costs.seconds_per_token()
        return per_token == 0.0 or self.copy_seconds_per_block < tokens * per_token

    def unswap(self, request: Request) -> None:
        """Put a preempted request's partial block back, if its full blocks all survived and the
        weights are those it was computed with."""
        if request.swapped is None:
            return
        model, length, layers = request.swapped
        request.swapped = None
        sequence, size = request.sequence, self.pool.block_size
        if model != self.prefixes.model or sequence.length != length // size * size:
            return  # new weights, or some full block was evicted meanwhile: recompute from there
        (block,) = self.pool.allocate(1, after=sequence.blocks[-1] if sequence.blocks else None)
        for (key, value), (host_key, host_value) in zip(self.pool.block_layers(block), layers):
            key.copy_(host_key)
            value.copy_(host_value)
        sequence.blocks.append(block)
        sequence.tokens, sequence.length = request.tokens()[:length], length
        sequence.history = bytearray(b"\x01" * length)
