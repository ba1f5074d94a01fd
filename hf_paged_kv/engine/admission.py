"""Admitting requests into the pool.

Admission probes the request's longest cached prefix (`PrefixProbe`: device blocks, and blocks
in the host or disk tier), checks the scheduler's memory rule on it, and only then inherits it
(promoting blocks from the tiers), allocates the first chunk and records which blocks the request
will compute, so that requests sharing that prefix wait and inherit it. A request that memory
turns away is probed at every step but inherits nothing: no lookup counted, no block touched,
nothing fed to the hot-spot pins.
A preempted request coming back gets its swapped partial block back (`preemption`). With both
latency targets and a host tier, a new request that memory turns away while it can still meet
its first-token target has running decodes with slack swapped out for it (`yielding`).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ..errors import PoolExhaustedError
from ..pool import KVPool
from ..sequence import Sequence
from . import yielding
from .costs import StepCosts
from .prefix_probe import PrefixProbe
from .preemption import Preemption
from .request import Request
from .scheduler import Scheduler

# how long (in time-to-first-token targets) a request that can no longer meet its target yields
# to those that still can, before it takes its turn again: a bound on how long triage delays it
LATE_YIELD = 4.0
# the share of the time-to-first-token target by which a partial prompt chunk may delay the first
# tokens of its forward; a longer delay defers the chunk to a later forward
PARTIAL_DELAY = 0.1
DEFERRED = 0  # `Admission._try`'s answer for such a chunk (a chunk it admits has at least a token)


class Admission:
    def __init__(self, pool: KVPool, scheduler: Scheduler):
        self.pool, self.scheduler = pool, scheduler
        self.prefixes = PrefixProbe(pool)
        self.costs = StepCosts()
        self.preemption = Preemption(pool, scheduler, self.costs, self.prefixes)
        self.lengths: deque = deque(maxlen=10_000)  # sequence lengths seen (prompt + generated), for advice
        self.on_admit = lambda waited: None  # the engine records queue waits for the controller
        self.on_impossible = lambda request, reason: None  # the engine fails a request no pool state could hold

    @property
    def model(self) -> str | None:
        return self.prefixes.model

    # ------------------------------------------------------------- admit
    def admit(self, budget: int, model: str | None, metrics,
              ends_prompts: bool) -> list[tuple[Request, int]]:
        """Admit waiting requests in turn (`in_turn`) while the memory rule and the budget
        allow. When memory turns one away, later requests of its priority that fit may pass it
        while it has waited less than `Limits.backfill_wait` (a burst's short prompts need not
        queue behind a long one); after that, and by a lower priority, it is never passed.

        With a time-to-first-token target (`Limits.ttft_target`), a new prompt that would only
        start in a forward that already ends some prompt (`ends_prompts`: the running sequences'
        part of the batch does) waits for a later forward when its partial chunk would delay
        their first tokens by more than `PARTIAL_DELAY` targets (at the marginal cost of a
        token): on bench_load's CPU trace three short prompts missed a 0.99 s target by
        0.01-0.03 s behind 87 tokens of a longer one in a 0.9 s forward. Nothing behind it in
        this step's order is admitted; it starts in the first forward where no prompt ends
        before it (the running part's included) or its chunk is cheap enough. Running prefills
        are few and the order's aging bounds how often later arrivals go first, so that comes."""
        with self.pool.locked():  # no other thread changes the pool between this step's probes and claims
            admitted, blocked = [], None
            target = self.scheduler.limits.ttft_target
            # fitted only when something waits: an empty queue admits nothing (the fit costs ~0.1 ms)
            fit = target is not None and self.scheduler.waiting
            per_token = self.costs.marginal_seconds_per_token() if fit else 0.0
            if model is not None:  # fingerprint of the weights, taken at each admitting step
                self.prefixes.model = model
            self.prefixes.keep_only(self.scheduler.waiting)
            pinned = self.pool.reuse.pins.pinned_blocks()
            for request in self.in_turn():
                if not self.scheduler.room_for_more(budget):
                    break
                if blocked is not None and request.effective_priority < blocked.effective_priority:
                    break
                if self._waits_for_inflight(request):
                    continue  # another request is computing its prefix: inherit it next step
                impossible = self._why_never_fits(request, pinned)
                if impossible:
                    self.on_impossible(request, impossible)
                    continue
                whole = ends_prompts and target is not None and budget * per_token > PARTIAL_DELAY * target
                count = self._try(request, budget, whole)
                if count is None and self._make_room(request, budget if whole else None, admitted, metrics):
                    count = self._try(request, budget, whole)
                if count == DEFERRED:
                    break
                if count is None:
                    if request.yielded and self._waiting_since(request) > time.monotonic():
                        continue  # a decode that yielded its memory lets others pass while it has slack left
                    blocked = blocked or request
                    if time.monotonic() - self._waiting_since(blocked) >= self.scheduler.limits.backfill_wait:
                        break
                    continue
                self.scheduler.waiting.remove(request)
                self.scheduler.running.append(request)
                request.yielded = False
                # a preempted request coming back inherits its own blocks, and those another computed
                # meanwhile past the tokens it had reached (a prefill preempted midway)
                metrics.inherited(max(0, request.inherited - request.reached))
                request.reached = max(request.reached, request.computed)
                if request.admitted is None:
                    request.admitted = time.monotonic()
                    metrics.admitted(request)
                    self.on_admit(request.admitted - request.arrived)
                admitted.append((request, count))
                budget -= count
                ends_prompts = ends_prompts or request.ends_prompt(count)
            return admitted

    def uncached(self, request: Request) -> int:
        """The tokens of a waiting request that its prefill would compute now (those not cached in
        the device pool)."""
        with self.pool.locked():
            return self.prefixes.uncached(request)

    def in_turn(self) -> list[Request]:
        """The waiting requests by priority, then by when their prompt would be in had it started
        at arrival (arrival + uncached tokens x recent seconds per token): within a burst the
        short prompts first, while a long prompt is passed only by requests that arrived less
        than its own compute time after it.

        With a time-to-first-token target (`Limits.ttft_target`), a request that can no longer
        meet it (its wait so far plus its compute passes the target) yields to the requests that
        still can, for `LATE_YIELD` targets: in a burst, serving one already late first only makes
        the next ones late too. A preempted request has had its first token and never yields."""
        per_token = self.costs.seconds_per_token()
        if per_token == 0.0 or len(self.scheduler.waiting) < 2:
            return list(self.scheduler.waiting)
        target, now = self.scheduler.limits.ttft_target, time.monotonic()

        def turn(request: Request) -> tuple[int, float]:
            compute = self.prefixes.uncached(request) * per_token
            late = target is not None and not request.generated and now + compute > request.arrived + target
            return -request.effective_priority, request.arrived + compute + (LATE_YIELD * target if late else 0.0)

        with self.pool.locked():  # the probes read the pool's index
            return sorted(self.scheduler.waiting, key=turn)

    def _why_never_fits(self, request: Request, pinned: set[int]) -> str | None:
        """Why the request's tokens can never fit: more blocks than the pool holds besides the
        `pinned` blocks it would not inherit (None when they fit)."""
        size, total = self.pool.block_size, self.pool.num_blocks
        needed = request.blocks_needed(size)
        if needed <= total - len(pinned):
            return None
        shared = set(self.prefixes.stored(request)[0])  # a pinned prefix it shares costs it nothing
        others = len(pinned - shared)
        if needed <= total - others:
            return None
        registry = self.pool.reuse.pins
        if needed <= total - len(registry.pinned_blocks(besides="hot") - shared):
            registry.forget(lambda pin, blocks: pin.reason == "hot")  # automatic pins are a cache policy: they give way
            return None
        pins = f", {others} of them pinned (unpin them or lower the pin budget)" if others else ""
        return (f"request {request.id} needs {request.kv_needed()} tokens of KV ({needed} blocks of {size}), "
                f"more than the pool can hold: {total} blocks{pins}; use a larger KVPool or a shorter request")

    def _make_room(self, request: Request, whole_budget: int | None, admitted: list, metrics) -> bool:
        """For a new request that memory turned away and that can still meet its first-token
        target, swap out running decodes with slack (`yielding`) when there is a host tier to
        take their blocks; never one admitted in this step (`admitted`), nor for a prompt that
        waits for a later forward anyway (its uncached part over `whole_budget`). True when some
        were."""
        target, now = self.scheduler.limits.ttft_target, time.monotonic()
        if request.generated or target is None or self.pool.tiers.host is None:
            return False
        prefix, stored = self.prefixes.stored(request)
        if whole_budget is not None and len(request.tokens()) - stored > whole_budget:
            return False
        if now + self.prefixes.uncached(request) * self.costs.seconds_per_token() > request.arrived + target:
            return False
        victims = self.scheduler.yielders(request, prefix, {r for r, _ in admitted}, self.costs.step_seconds(), now)
        for victim in victims:
            metrics.preempted(self.preemption.preempt(victim, yielding=True), yielding=True)
        return bool(victims)

    def _waiting_since(self, request: Request) -> float:
        """When the request began to wait for its turn: its arrival, or for a decode that yielded
        its memory, the moment its slack runs out (until then it holds no one back)."""
        target = self.scheduler.limits.per_token_target
        if not request.yielded or target is None:
            return request.arrived
        now = time.monotonic()
        return now + yielding.slack(request, target, self.costs.step_seconds(), now)

    def _try(self, request: Request, budget: int, whole: bool = False) -> int | None:
        """Attach the cached prefix and the first chunk's blocks; the chunk size, None (and
        nothing held) when memory does not allow it, or `DEFERRED` (nothing held, touched or
        moved) when `whole` and a new prompt's uncached part does not fit in `budget`."""
        tokens = request.tokens()
        with self.pool.locked():
            prefix, stored = self.prefixes.stored(request)
            # probed first: inheriting counts a lookup, touches the blocks, feeds the hot-spot pins
            # and promotes from the tiers, which a request that memory turns away every step must not
            fits = self.scheduler.shortfall_inheriting(request, prefix) <= 0
            if whole and not request.generated and len(tokens) - stored > budget:
                return DEFERRED if fits else None
            if not fits:
                return None
            blocks, length = self.pool.reuse.inherit(
                self.model, request.tenant, np.asarray(tokens, dtype=np.int64), len(tokens) - 1,
                lambda digest, after: self.pool.promote(digest, self.model, after))
            if not self.scheduler.admissible(request, len(blocks)):  # the probe's answer, unless a promotion failed
                self.pool.decref(blocks)
                return None
            request.sequence = Sequence(blocks=blocks, length=length, tokens=tokens[:length],
                                        history=bytearray(b"\x01" * length))
            swapped = request.swapped
            try:
                self.preemption.unswap(request)
                request.computed = request.inherited = request.sequence.length
                count = min(request.remaining, budget)
                self.pool.grow([request.sequence], [count])
            except PoolExhaustedError:  # nothing lost: a preempted request keeps its host copy for the next try
                self.pool.decref(request.sequence.blocks)
                request.sequence, request.computed, request.swapped = Sequence(), 0, swapped
                return None
            self._register_inflight(request)
        return count

    # ---------------------------------------------------------- prefetch
    def prefetch(self, depth: int, watermark: float) -> int:
        """Bring the next `depth` waiting requests' prefixes back from the host or disk tier
        before their turn, only into free blocks above `watermark` (a fraction of the pool), so
        prefetching never evicts anything. The blocks stay cached, unreferenced; returns the
        tokens brought back."""
        if self.model is None or self.pool.tiers.empty:
            return 0
        keep_free = int(watermark * self.pool.num_blocks) + 1

        def promote(digest: bytes, after: int | None):
            return self.pool.promote(digest, self.model, after) if self.pool.num_free() > keep_free else None

        brought = 0
        with self.pool.locked():
            for request in self.in_turn()[:depth]:
                brought += self.pool.reuse.bring_back(self.model, request.tenant, np.asarray(request.tokens()),
                                                      promote)
        return brought

    # ---------------------------------------------------- shared prefixes
    def _waits_for_inflight(self, request: Request) -> bool:
        return bool(self.scheduler.inflight) and self.scheduler.waits_for_inflight(self.prefixes.chain(request))

    def _register_inflight(self, request: Request) -> None:
        computed_blocks = request.sequence.length // self.pool.block_size
        for digest in self.prefixes.chain(request)[computed_blocks:]:
            self.scheduler.inflight.setdefault(digest, request)

    def indexed(self, batch: list[tuple[Request, int]]) -> None:
        """After a forward: index the sequences' newly full blocks, so waiting requests sharing
        them inherit them; those digests are no longer in flight."""
        with self.pool.locked():
            for request, _ in batch:
                if request.outcome is None:
                    self.pool.reuse.index_sequence(self.model, request.tenant, request.sequence, request.priority)
            now = self.pool.policy.now()
            self.scheduler.inflight = {d: r for d, r in self.scheduler.inflight.items()
                                       if r.outcome is None and self.pool.reuse.index.lookup(d, now) is None}
