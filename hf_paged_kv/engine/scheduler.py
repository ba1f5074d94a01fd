"""Which sequences run in the next forward, which wait, and which give way.

Every step takes, within a token budget: the decode step of every running sequence, then the
next chunk of the prefills in progress, then new requests. A new request is admitted only if
the pool's free and evictable blocks cover its uncached tokens plus a reserve for the running
sequences' growth – an estimated share (`growth_ratio`) of their remaining `max_new_tokens`,
which decays while memory holds and is reset by a preemption (SGLang's rule) and is capped by
the share that finished requests did generate (see `growth`), each request's counted up to
`Limits.growth_clip` tokens and `MAX_GROWTH_SHARE` of the pool – and never in a step that
preempted. Waiting requests are admitted by priority, then shortest expected prompt
first with aging, and, given a time-to-first-token target, those that can still meet it before
those that cannot, and in a forward that already ends prompts no other prompt starts with a
partial chunk that would delay their first tokens by more than a tenth of the target (see
`Admission`). A request whose prompt continues a prefix that a running
prefill is about to compute waits for those blocks and inherits them instead of computing them
twice.

When a running sequence needs a block and the pool has none to give, the scheduler preempts a
victim – lowest priority first, then the cheapest to resume – instead of failing: its full
blocks stay cached for its return, its partial last block is kept in host memory when copying
it back is cheaper than recomputing it, and it goes back to the queue with its priority raised
by one (so a request cannot be preempted forever).
"""

from __future__ import annotations

from ..errors import PoolExhaustedError
from ..pool import KVPool
from . import yielding
from .config import Limits
from .growth import GrowthShare
from .request import Request


MAX_GROWTH_SHARE = 0.125  # of the pool: the most one request's growth reserve counts (see Scheduler._growth)


class Scheduler:
    def __init__(self, pool: KVPool, limits: Limits):
        self.pool, self.limits = pool, limits
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.growth = GrowthShare(limits)
        self.inflight: dict[bytes, Request] = {}  # digests of blocks a running prefill will index

    # ------------------------------------------------------------ queues
    def enqueue(self, request: Request) -> None:
        """Insert by priority (preempted requests carry theirs raised), then arrival."""
        key = (-request.effective_priority, request.arrived)
        index = next((i for i, r in enumerate(self.waiting) if (-r.effective_priority, r.arrived) > key),
                     len(self.waiting))
        self.waiting.insert(index, request)

    def remove(self, request: Request) -> None:
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        self.forget_inflight(request)

    def forget_inflight(self, request: Request) -> None:
        self.inflight = {d: r for d, r in self.inflight.items() if r is not request}

    # ----------------------------------------------------------- choosing
    def continuing(self, budget: int) -> list[tuple[Request, int]]:
        """The running sequences' tokens for this step: every decode, then prefill chunks."""
        decodes = [(r, 1) for r in self.running if r.remaining == 1]
        budget -= len(decodes)
        chunks = []
        for request in self.running:
            if request.remaining > 1 and budget > 0:
                chunks.append((request, min(request.remaining, budget)))
                budget -= chunks[-1][1]
        return decodes + chunks

    def reserve(self) -> int:
        """Blocks to keep for the running sequences' growth: their unfed tokens, and a share of
        what they may still generate."""
        return int(sum(self._growth(request) for request in self.running)) + len(self.running)

    def _growth(self, request: Request) -> float:
        """Blocks the request may still need: its unfed tokens, and the growth share of what it
        may still generate."""
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

    def finished(self, request: Request) -> None:
        """A request finished: the share of its allowance it generated goes into the estimate."""
        allowance = self.clipped(request.params.max_new_tokens)
        self.growth.finished(min(1.0, len(request.generated) / allowance))

    def shortfall(self, request: Request, inherited_blocks: int) -> int:
        """Blocks that memory lacks for the request's uncached tokens and the running ones'
        reserve (<= 0: it fits)."""
        needed = request.blocks_needed(self.pool.block_size) - inherited_blocks
        # the watermark keeps room for running sequences: with none, a request it alone turns
        # away would wait forever
        keep_free = int(self.limits.watermark * self.pool.num_blocks) if self.running else 0
        return needed + self.reserve() + keep_free - self.pool.num_available()

    def admissible(self, request: Request, inherited_blocks: int) -> bool:
        """Whether memory covers the request's uncached tokens and the running ones' reserve."""
        return self.shortfall(request, inherited_blocks) <= 0

    def shortfall_inheriting(self, request: Request, prefix: list[int]) -> int:
        """`shortfall` for a request that would inherit the device blocks `prefix`: inheriting a
        block that a sequence holds spares the request a block; an idle cached one (already
        counted as available) or one in a lower tier spares nothing."""
        return self.shortfall(request, self.pool.allocator.referenced(prefix))

    def yielders(self, request: Request, prefix: list[int], protected: set[Request], step_seconds: float,
                 now: float) -> list[Request]:
        """The running decodes (other than `protected` ones) to swap out so that `request` fits
        (see `yielding`); none when they cannot make the room or decodes never yield (no
        per-token or first-token target). `prefix`: the device blocks `request` would inherit."""
        limits = self.limits
        if limits.per_token_target is None or limits.ttft_target is None:
            return []
        kept = set(prefix)
        with self.pool.locked():
            shortfall = self.shortfall_inheriting(request, prefix)

            def frees(victim: Request) -> int:  # blocks it alone holds outside the prefix, and its reserve share
                released = [block for block in victim.sequence.blocks if block not in kept]
                return self.pool.allocator.held_alone(released) + int(self._growth(victim)) + 1

            candidates = [r for r in self.running if r not in protected]
            return yielding.victims(candidates, request, shortfall, frees, limits.per_token_target,
                                    yielding.MIN_SLACK * limits.ttft_target, step_seconds, now)

    def room_for_more(self, budget: int) -> bool:
        return budget > 0 and len(self.running) < self.limits.max_running

    def waits_for_inflight(self, digests: list[bytes]) -> bool:
        """Whether a running prefill is about to index one of these blocks."""
        return any(d in self.inflight for d in digests)

    def decay(self) -> None:
        self.growth.step()

    # ----------------------------------------------------------- memory
    def grow(self, batch: list[tuple[Request, int]], preempt) -> list[tuple[Request, int]]:
        """Allocate the blocks `batch` needs, preempting victims (via `preempt(request)`) until
        it fits; returns what is left of the batch."""
        while batch:
            try:
                self.pool.grow([r.sequence for r, _ in batch], [n for _, n in batch])
                return batch
            except PoolExhaustedError:
                victim = self.victim()
                if victim is None:
                    raise
                preempt(victim)
                self.growth.preempted()
                batch = [(r, n) for r, n in batch if r is not victim]
        return batch

    def victim(self) -> Request | None:
        """Lowest priority first, then the cheapest to resume (fewest tokens stored)."""
        if not self.running:
            return None
        return min(self.running, key=lambda r: (r.effective_priority, r.computed, -r.arrived))
