"""Lending a decode's blocks to a request about to miss its first-token target.

In a burst the pool can be full of sequences decoding well inside their per-token target while
a new request waits for memory and runs out of time for its first token. With both targets set
(`Limits.ttft_target` and `Limits.per_token_target`; the controller sets them from its SLO), a
request that memory turned away at the last admission, that has had no token yet and can still
meet its target, borrows the blocks of one running decode whose slack covers the pause. The
decode is preempted as any victim is (its full blocks stay cached, its partial block is swapped
or recomputed; its priority is raised by one), the borrower is admitted first in that same step,
and the decode stays out of admission while the borrower waits – one TTFT target at most – then
resumes, once memory allows, with the output it would have had.

A decode's per-token latency is the mean over its tokens, as the target counts it, so its slack
is the time its tokens so far saved against the target's pace; its tokens to come, faster than
the target too, are not counted. The pause its slack must cover: one TTFT target, and the
recompute of its own tokens should its cached blocks be evicted meanwhile. It lends only if its
release covers the borrower's shortfall and leaves room for its own return beside the borrower
(its partial block, the borrower's growth reserve). A request lends at most once and borrows at
most once, and a decode never lends to a request of a lower priority. A lending is not memory
running out: it sends the controller no preemption signal.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from .request import Request
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .admission import Admission

log = logging.getLogger("hf_paged_kv.engine")


def lend(admission: Admission, batch: list[tuple[Request, int]], preempt) -> list[tuple[Request, int]]:
    """Before this step's admission: when a decode should lend its blocks (see the module doc),
    preempt it (`preempt(request)`) and mark the borrower to be admitted first; returns `batch`
    without the lender."""
    borrower, admission.borrower = admission.blocked, None
    chosen = _lender_for(admission, borrower) if borrower is not None else None
    if chosen is None:
        return batch
    now, ttft = time.monotonic(), admission.scheduler.limits.ttft_target
    borrower.borrowed, admission.borrower = True, borrower
    chosen.lent_to, chosen.lent_until = borrower, now + ttft
    log.info("request %d lends its blocks to request %d (%.2f s of slack)", chosen.id, borrower.id,
             slack(chosen, now, admission.scheduler.limits.per_token_target))
    preempt(chosen)
    return [(request, count) for request, count in batch if request is not chosen]


def _lender_for(admission: Admission, borrower: Request) -> Request | None:
    """The decode that should lend its blocks to `borrower` now, or None."""
    scheduler, pool = admission.scheduler, admission.pool
    limits = scheduler.limits
    if limits.per_token_target is None or limits.ttft_target is None:
        return None
    if borrower.borrowed or borrower.generated or borrower not in scheduler.waiting:
        return None
    now, per_token = time.monotonic(), admission.costs.seconds_per_token()
    with pool.locked():
        if now - borrower.arrived + admission.uncached(borrower) * per_token > limits.ttft_target:
            return None  # too late for the target whatever happens: a pause would only add a miss
        # its cached prefix's blocks that sequences hold cost it nothing; idle ones it takes out of the available
        inherits = (len(borrower.tokens()) - 1) // pool.block_size  # as far as `inherit` goes
        prefix = np.asarray(pool.reuse.device_blocks(admission.digest_pairs(borrower)[:inherits]), dtype=np.int64)
        held = int(np.count_nonzero(pool.allocator.refcount[prefix] > 0))
        shortfall = scheduler.shortfall(borrower, held)
        if shortfall <= 0:
            return None  # it fits now
        room = shortfall + int(scheduler.growth_ratio * borrower.params.max_new_tokens / pool.block_size) + 2
        return lender(scheduler, borrower, room, now, per_token, pool.allocator.refcount, prefix)


def slack(request: Request, now: float, per_token_target: float) -> float:
    """Seconds the request could stop now and still have its mean time between tokens so far
    within `per_token_target` (negative: already behind); 0.0 before its second token."""
    tokens = len(request.generated)
    if tokens < 2 or request.first_token is None:
        return 0.0
    return per_token_target * (tokens - 1) - (now - request.first_token)


def lender(scheduler: Scheduler, borrower: Request, room: int, now: float, seconds_per_token: float,
           refcount: np.ndarray, prefix: np.ndarray) -> Request | None:
    """The running decode with the most slack beyond its pause whose release frees `room`
    blocks (those only it references, outside the borrower's `prefix`, which the borrower would
    take back, and its share of the growth reserve), or None. `refcount`: the pool's per block."""
    limits, best, most = scheduler.limits, None, 0.0
    for request in scheduler.running:
        if request.remaining != 1 or request.lent_until:
            continue  # a prefill still in progress, or a decode that lent once already
        if request.effective_priority > borrower.effective_priority:
            continue
        blocks = np.setdiff1d(np.asarray(request.sequence.blocks, dtype=np.int64), prefix)
        frees = int(np.count_nonzero(refcount[blocks] == 1)) + int(scheduler.growth(request)) + 1
        pause = limits.ttft_target + len(request.tokens()) * seconds_per_token
        spare = slack(request, now, limits.per_token_target) - pause
        if frees >= room and spare >= most:
            best, most = request, spare
    return best


def lending_order(order: list[Request], waiting: list[Request], borrower: Request | None,
                  now: float) -> list[Request]:
    """Admission's `order` with the borrower first and without the lenders whose borrower still
    waits (for less than their bound); a lender whose wait is over forgets its borrower."""
    kept = []
    for request in order:
        if request.lent_to is not None and now < request.lent_until and request.lent_to in waiting:
            continue
        request.lent_to = None
        kept.append(request)
    return sorted(kept, key=lambda request: request is not borrower)  # stable: the rest keep their order
