"""The engine's one scheduler: it alone holds the waiting and running queues, and each step it
returns the step's plan – which sequences run and how many tokens each feeds, which were
preempted, which were admitted – under one token budget, a cap on running sequences and the
pool's free blocks. Decodes, prefill chunks and new prompts share the budget; there are no
separate prefill and decode phases.

    scheduler.submit(request)                   # from any thread
    scheduler.intake()                          # the engine's loop: submitted requests queue
    plan = scheduler.schedule(model)            # `model`: the weights' fingerprint
    ...                                         # one forward of plan.batch, then sampling
    scheduler.committed(plan.batch)             # their newly full blocks become reusable
    scheduler.stepped(tokens, seconds, whole)   # what the step cost
    scheduler.finish(request, "finished")       # it leaves the queues; its KV is released

One step, in `schedule`:

1. The budget: `Limits.max_batch_tokens`, paced against latency targets when they are set
   (`pacing`).
2. Every running decode, then the next chunk of each running prefill.
3. Their blocks. Where the pool has none to give, a running sequence is preempted instead of
   failing (`preempt`): the lowest priority first, then the cheapest to resume.
4. Only in a step that preempted nothing: waiting requests are admitted in turn while the
   budget, `Limits.max_running` and memory allow.

Memory rule: a request is admitted only if the free and evictable blocks cover its uncached
tokens plus a reserve for the running sequences' growth (`reserve`: an estimated share of their
remaining `max_new_tokens`, see `growth`) and the `Limits.watermark`. A request memory turns
away is passed by no one: admission stops there until it fits.

Turn: by priority, then by when the prompt would be in had it started at arrival (arrival +
uncached tokens x recent seconds per token): a burst's short prompts first, while a long prompt
is passed only by requests that arrived less than its own compute time after it.

A request whose prompt continues a prefix that a running prefill is computing waits for those
blocks and inherits them instead of computing them twice. A preempted request keeps its full
blocks cached (indexed as soon as they fill) and its partial last block on the host when copying
it back is cheaper than recomputing it; it returns to the queue with its priority raised by one,
so none is preempted forever, and resumes with exactly the KV it had.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field

from ..cache.sequence import Sequence
from ..errors import PoolExhaustedError
from ..pool import KVPool
from . import pacing
from .config import Limits
from .costs import StepCosts
from .growth import GrowthShare
from .prefix_probe import PrefixProbe
from .request import Request

log = logging.getLogger("hf_paged_kv.engine")

MAX_GROWTH_SHARE = 0.125  # of the pool: the most one request's growth reserve counts (see `clipped`)
# the share of the time-to-first-token target by which a partial prompt chunk may delay the first
# tokens of its forward; a longer delay defers the chunk to a later forward (see `_admit`)
PARTIAL_DELAY = 0.1
DEFERRED = 0  # `_try`'s answer for such a chunk (a chunk it admits has at least a token)


@dataclass
class Schedule:
    """One step's plan, as `Scheduler.schedule` returns it."""

    batch: list[tuple[Request, int]] = field(default_factory=list)  # who runs, and how many tokens each feeds
    admitted: list[Request] = field(default_factory=list)  # admitted for the first time (not resumed)
    preempted: list[tuple[Request, str]] = field(default_factory=list)  # and how: "swap" or "recompute"
    # waiting requests no pool state can hold, and why: still queued, for the engine to end (an error
    # before it does leaves them in the queue, where a failing step's end_all finds them)
    impossible: list[tuple[Request, str]] = field(default_factory=list)
    inherited: int = 0  # prompt tokens the admissions inherited that no forward of theirs computed


class Scheduler:
    def __init__(self, pool: KVPool, limits: Limits):
        self.pool, self.limits = pool, limits
        self.incoming: queue.Queue = queue.Queue()  # submitted from any thread, not yet in `waiting`
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.growth = GrowthShare(limits)
        self.costs = StepCosts()
        self.prefixes = PrefixProbe(pool)
        self.inflight: dict[bytes, Request] = {}  # digests of blocks a running prefill will index
        self.copy_seconds_per_block = 0.0  # the last swap's cost, weighed against recomputing
        self.lengths: deque = deque(maxlen=10_000)  # finished sequences' lengths, for block size advice

    # ------------------------------------------------------------ queues
    def submit(self, request: Request) -> None:
        """Queue a request from any thread; the loop's `intake` moves it into `waiting`."""
        self.incoming.put(request)

    def intake(self) -> None:
        """Move the submitted requests into `waiting` (one cancelled since has ended: dropped)."""
        while not self.incoming.empty():
            request = self.incoming.get()
            if request.outcome is None:
                self.add(request)

    def queued(self) -> list[Request]:
        """Every request not yet running: those waiting, then those submitted since the last intake."""
        return [*self.waiting, *self.incoming.queue.copy()]

    def backlog(self) -> int:
        """How many requests are not yet running."""
        return len(self.waiting) + self.incoming.qsize()

    def busy(self) -> bool:
        return bool(self.waiting or self.running) or not self.incoming.empty()

    def add(self, request: Request) -> None:
        """Queue by priority (preempted requests carry theirs raised), then arrival."""
        key = (-request.effective_priority, request.arrived)
        index = next((i for i, r in enumerate(self.waiting) if (-r.effective_priority, r.arrived) > key),
                     len(self.waiting))
        self.waiting.insert(index, request)

    def finish(self, request: Request, outcome: str) -> None:
        """The request leaves the queues and its KV is released (full blocks stay cached); a
        finished one's share of its allowance goes into the growth estimate."""
        self._remove(request)
        if request.sequence.blocks:
            self.pool.decref(request.sequence.blocks)
        request.sequence, request.swapped = Sequence(), None
        if outcome == "finished":
            allowance = self.clipped(request.params.max_new_tokens)
            self.growth.finished(min(1.0, len(request.generated) / allowance))
            self.lengths.append(len(request.prompt) + len(request.generated))

    def _remove(self, request: Request) -> None:
        for line in (self.waiting, self.running):
            if request in line:
                line.remove(request)
        self.inflight = {d: r for d, r in self.inflight.items() if r is not request}

    # -------------------------------------------------------------- step
    def schedule(self, model: str | None) -> Schedule:
        """The next step's plan. `model`: the weights' fingerprint, taken when requests wait (None
        keeps the last one). Raises `PoolExhaustedError` only when the running sequences' next
        tokens cannot fit even with every other one preempted."""
        plan = Schedule()
        if model is not None:
            self.prefixes.model = model
        budget = self._budget()
        batch = self._grow(self._continuing(budget), plan)
        if not plan.preempted:  # admitting now would take the room the preemption just made
            ends_prompts = any(request.ends_prompt(n) for request, n in batch)
            batch += self._admit(budget - sum(n for _, n in batch), ends_prompts, plan)
        plan.batch = batch
        return plan

    def committed(self, batch: list[tuple[Request, int]]) -> None:
        """After a forward: index the sequences' newly full blocks, so that waiting requests sharing
        them inherit them; those blocks are no longer in flight."""
        with self.pool.locked():
            for request, _ in batch:
                if request.outcome is None:
                    self.pool.publish_blocks(self.prefixes.model, request.tenant, request.sequence, request.priority)
            self.inflight = {d: r for d, r in self.inflight.items() if r.outcome is None and not self.pool.is_cached(d)}

    def stepped(self, tokens: int, seconds: float, whole: bool) -> None:
        """A step ran `tokens` in `seconds`: the growth share decays (a preemption resets it); its
        cost is recorded when it ran as one forward (`whole`), not row by row after a failure."""
        self.growth.step()
        if whole:
            self.costs.record(tokens, seconds)

    def _budget(self) -> int:
        # with a TTFT target, the budget reads the prompts in line in admission's order
        line = self.in_turn() if self.limits.ttft_target is not None else self.waiting
        return pacing.step_budget(self.running, line, self.limits, self.costs, uncached=self.uncached)

    def _continuing(self, budget: int) -> list[tuple[Request, int]]:
        """The running sequences' tokens for this step: every decode, then prefill chunks."""
        decodes = [(r, 1) for r in self.running if r.remaining == 1]
        budget -= len(decodes)
        chunks = []
        for request in self.running:
            if request.remaining > 1 and budget > 0:
                chunks.append((request, min(request.remaining, budget)))
                budget -= chunks[-1][1]
        return decodes + chunks

    def _grow(self, batch: list[tuple[Request, int]], plan: Schedule) -> list[tuple[Request, int]]:
        """Allocate the blocks `batch` needs, preempting victims until it fits; what is left of it."""
        while batch:
            try:
                self.pool.grow([r.sequence for r, _ in batch], [n for _, n in batch])
                return batch
            except PoolExhaustedError:
                victim = self._victim()
                if victim is None:
                    raise
                plan.preempted.append((victim, self.preempt(victim)))
                self.growth.preempted()
                batch = [(r, n) for r, n in batch if r is not victim]
        return batch

    def _victim(self) -> Request | None:
        """Lowest priority first, then the cheapest to resume (fewest tokens stored)."""
        if not self.running:
            return None
        return min(self.running, key=lambda r: (r.effective_priority, r.computed, -r.arrived))

    # ------------------------------------------------------------ memory
    def reserve(self) -> int:
        """Blocks kept for the running sequences' growth: their unfed tokens, and a share of what
        they may still generate."""
        return int(sum(self._growth(request) for request in self.running)) + len(self.running)

    def _growth(self, request: Request) -> float:
        to_generate = self.clipped(request.params.max_new_tokens - len(request.generated))
        return (request.remaining + self.growth.ratio * to_generate) / self.pool.block_size

    def clipped(self, tokens: int) -> int:
        """Tokens yet to generate as the reserve counts them: at most `Limits.growth_clip` and
        `MAX_GROWTH_SHARE` of the pool (more would leave room for fewer than eight requests'
        reserves: a static reservation)."""
        if self.limits.growth_clip is None:
            return tokens
        pool_tokens = self.pool.num_blocks * self.pool.block_size
        return min(tokens, self.limits.growth_clip, int(MAX_GROWTH_SHARE * pool_tokens))

    def _shortfall(self, request: Request, inherited_blocks: int) -> int:
        """Blocks that memory lacks for the request's uncached tokens and the running ones'
        reserve (<= 0: it fits)."""
        needed = request.blocks_needed(self.pool.block_size) - inherited_blocks
        # the watermark keeps room for running sequences: with none, a request it alone turns
        # away would wait forever
        keep_free = int(self.limits.watermark * self.pool.num_blocks) if self.running else 0
        return needed + self.reserve() + keep_free - self.pool.num_available()

    def _fits_inheriting(self, request: Request, prefix: list[int]) -> bool:
        """The memory rule for a request that would inherit the device blocks `prefix`: inheriting
        a block that a sequence holds spares it a block; an idle cached one (already counted as
        available) or one in a lower tier spares nothing."""
        return self._shortfall(request, self.pool.referenced(prefix)) <= 0

    # --------------------------------------------------------- admission
    def in_turn(self) -> list[Request]:
        """The waiting requests by priority, then by when their prompt would be in had it started
        at arrival (arrival + uncached tokens x recent seconds per token)."""
        per_token = self.costs.seconds_per_token()
        if per_token == 0.0 or len(self.waiting) < 2:
            return list(self.waiting)
        with self.pool.locked():  # the probes read the pool's index
            return sorted(self.waiting, key=lambda r: (-r.effective_priority,
                                                       r.arrived + self.prefixes.uncached(r) * per_token))

    def uncached(self, request: Request) -> int:
        """The tokens of a waiting request that its prefill would compute now (those not cached in
        the device pool)."""
        with self.pool.locked():
            return self.prefixes.uncached(request)

    def _admit(self, budget: int, ends_prompts: bool, plan: Schedule) -> list[tuple[Request, int]]:
        """Admit waiting requests in turn while the budget, `max_running` and the memory rule
        allow; the first that memory turns away ends admission for this step.

        With a time-to-first-token target (`Limits.ttft_target`), a new prompt that would only
        start in a forward that already ends some prompt (`ends_prompts`) waits for a later
        forward when its partial chunk would delay their first tokens by more than
        `PARTIAL_DELAY` targets (at the marginal cost of a token); nothing behind it is admitted
        in this step."""
        with self.pool.locked():  # no other thread changes the pool between this step's probes and claims
            admitted = []
            target = self.limits.ttft_target
            # fitted only when something waits: an empty queue admits nothing (the fit costs ~0.1 ms)
            per_token = self.costs.marginal_seconds_per_token() if target is not None and self.waiting else 0.0
            self.prefixes.keep_only(self.waiting)
            pinned = self.pool.pinned_blocks()
            for request in self.in_turn():
                if budget <= 0 or len(self.running) >= self.limits.max_running:
                    break
                if self.inflight and any(d in self.inflight for d in self.prefixes.chain(request)):
                    continue  # another request is computing its prefix: it inherits it next step
                impossible = self._why_never_fits(request, pinned)
                if impossible:
                    plan.impossible.append((request, impossible))
                    continue
                whole = ends_prompts and target is not None and budget * per_token > PARTIAL_DELAY * target
                count = self._try(request, budget, whole)
                if count is None or count == DEFERRED:
                    break
                self.waiting.remove(request)
                self.running.append(request)
                # a preempted request coming back inherits its own blocks, and those another computed
                # meanwhile past the tokens it had reached (a prefill preempted midway)
                plan.inherited += max(0, request.inherited - request.reached)
                request.reached = max(request.reached, request.computed)
                if request.admitted is None:
                    request.admitted = time.monotonic()
                    plan.admitted.append(request)
                admitted.append((request, count))
                budget -= count
                ends_prompts = ends_prompts or request.ends_prompt(count)
            return admitted

    def _why_never_fits(self, request: Request, pinned: set[int]) -> str | None:
        """Why the request's tokens can never fit: more blocks than the pool holds besides the
        `pinned` blocks it would not inherit (None when they fit). Automatic (hot) pins give way
        to it: they are a cache policy."""
        size, total = self.pool.block_size, self.pool.num_blocks
        needed = request.blocks_needed(size)
        if needed <= total - len(pinned):
            return None
        shared = set(self.prefixes.stored(request)[0])  # a pinned prefix it shares costs it nothing
        others = len(pinned - shared)
        if needed <= total - others:
            return None
        if needed <= total - len(self.pool.pinned_blocks(besides="hot") - shared):
            self.pool.unpin_hot()
            return None
        pins = f", {others} of them pinned (unpin them or lower the pin budget)" if others else ""
        return (f"request {request.id} needs {request.kv_needed()} tokens of KV ({needed} blocks of {size}), "
                f"more than the pool can hold: {total} blocks{pins}; use a larger KVPool or a shorter request")

    def _try(self, request: Request, budget: int, whole: bool = False) -> int | None:
        """Attach the cached prefix and the first chunk's blocks; the chunk size, None (and
        nothing held) when memory does not allow it, or `DEFERRED` (nothing held, touched or
        moved) when `whole` and a new prompt's uncached part does not fit in `budget`."""
        tokens = request.tokens()
        with self.pool.locked():
            prefix, stored = self.prefixes.stored(request)
            # probed first: inheriting counts a lookup, touches the blocks, feeds the hot-spot pins
            # and promotes from the tiers, which a request that memory turns away every step must not
            fits = self._fits_inheriting(request, prefix)
            if whole and not request.generated and len(tokens) - stored > budget:
                return DEFERRED if fits else None
            if not fits:
                return None
            blocks, length = self.pool.inherit(self.prefixes.model, request.tenant, tokens, len(tokens) - 1)
            if self._shortfall(request, len(blocks)) > 0:  # the probe's answer, unless a promotion failed
                self.pool.decref(blocks)
                return None
            request.sequence = Sequence(blocks=blocks, length=length, tokens=tokens[:length],
                                        history=bytearray(b"\x01" * length))
            swapped = request.swapped
            try:
                self._unswap(request)
                request.computed = request.inherited = request.sequence.length
                count = min(request.remaining, budget)
                self.pool.grow([request.sequence], [count])
            except PoolExhaustedError:  # nothing lost: a preempted request keeps its host copy for the next try
                self.pool.decref(request.sequence.blocks)
                request.sequence, request.computed, request.swapped = Sequence(), 0, swapped
                return None
            computed_blocks = request.sequence.length // self.pool.block_size
            for digest in self.prefixes.chain(request)[computed_blocks:]:  # what sharers wait for
                self.inflight.setdefault(digest, request)
        return count

    # -------------------------------------------------------- preemption
    def preempt(self, request: Request) -> str:
        """Send a running request back to the queue with its priority raised by one; returns how
        its partial last block is kept: "swap" (a copy on the host) or "recompute". Its full
        blocks stay cached for its return."""
        sequence, size = request.sequence, self.pool.block_size
        partial = sequence.partial_block(size)
        mode = "recompute"
        if partial is not None and self._swap_is_cheaper(sequence.length % size):
            started = time.perf_counter()
            # labelled with the weights as admission last took them (the full blocks' index entries
            # are too): after the weights change it is dropped and the tokens computed again
            request.swapped = (self.prefixes.model, sequence.length,
                               [(k.to("cpu", copy=True), v.to("cpu", copy=True))
                                for k, v in self.pool.block_layers(partial)])
            self.copy_seconds_per_block = time.perf_counter() - started
            mode = "swap"
        self._remove(request)
        self.pool.decref(sequence.blocks)  # full blocks were indexed: they stay cached
        request.sequence, request.computed = Sequence(), 0
        request.preemptions += 1
        self.add(request)
        log.info("preempted request %d (%s, %d tokens stored), its priority now %d", request.id, mode,
                 sequence.length, request.effective_priority)
        return mode

    def _swap_is_cheaper(self, tokens: int) -> bool:
        per_token = self.costs.seconds_per_token()
        return per_token == 0.0 or self.copy_seconds_per_block < tokens * per_token

    def _unswap(self, request: Request) -> None:
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
