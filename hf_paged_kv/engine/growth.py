"""The share of their remaining `max_new_tokens` that admission keeps free for running sequences.

SGLang's rule, which the scheduler follows: the share starts at `Limits.growth_ratio_init`
(0.7), decays by `growth_ratio_decay` per step while no sequence is preempted, never below
`growth_ratio_min`, and a preemption resets it. Its start is a guess made before any output is
seen, and a poor one for clients that ask for far more tokens than they use: in a burst of 64
SmolLM2 requests allowed 256-1024 tokens that stopped after 130 on average, the rule alone ran
at most 11 at once in a pool where a static reservation fits 9, and the estimate 28
(docs/benchmarks.md, "Capacity").

So the share is also capped by what finished requests did use: the mean share of their
(clipped) allowance that the last `WINDOW` finished requests generated – the expected growth of
a request that has just started – once `TRUST_AFTER` requests have finished since the last
preemption. A running set that long requests dominate grows by more than that; when the reserve
falls short, a sequence is preempted (and resumes with the same output), and the share goes back
to SGLang's rule until fresh evidence comes in (at the caps above: 6 preemptions against the
rule's 2). `Limits.growth_from_outputs=False` keeps
SGLang's rule alone.

    share = GrowthShare(Limits())
    share.ratio                 # 0.7: nothing seen yet
    for _ in range(8):
        share.finished(0.15)    # each finished request generated 15 % of its allowance
    share.ratio                 # 0.15
"""

from __future__ import annotations

import statistics
from collections import deque

from .config import Limits

WINDOW = 128  # finished requests whose shares the estimate averages
TRUST_AFTER = 8  # finished requests since the last preemption before the estimate caps the share


class GrowthShare:
    def __init__(self, limits: Limits):
        self.limits = limits
        self.rule = limits.growth_ratio_init  # SGLang's decaying share
        self.used: deque[float] = deque(maxlen=WINDOW)
        self.mean_used = 0.0  # of `used`, kept at each finish: the reserve reads it per running request
        self.since_preemption = 0

    @property
    def ratio(self) -> float:
        """The share the reserve counts now: SGLang's, capped by the estimate, at least the least."""
        estimate = self.estimate
        share = self.rule if estimate is None else min(self.rule, estimate)
        return max(self.limits.growth_ratio_min, share)

    @property
    def estimate(self) -> float | None:
        """The mean share of their allowance that recent finished requests generated; None until
        it is trusted (or when `Limits.growth_from_outputs` is off)."""
        if not self.limits.growth_from_outputs or self.since_preemption < TRUST_AFTER:
            return None
        return self.mean_used

    def step(self) -> None:
        """A step ran without preempting: SGLang's share decays."""
        self.rule = max(self.limits.growth_ratio_min, self.rule - self.limits.growth_ratio_decay)

    def preempted(self) -> None:
        self.rule = self.limits.growth_ratio_init
        self.since_preemption = 0

    def finished(self, share: float) -> None:
        """A request finished having generated `share` (in [0, 1]) of its allowance."""
        if not 0 <= share <= 1:
            raise ValueError(f"a share of the allowance is in [0, 1], got {share}")
        self.used.append(share)
        self.mean_used = statistics.fmean(self.used)
        self.since_preemption += 1
