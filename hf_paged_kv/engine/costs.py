"""What the engine's recent steps cost: the figures admission orders the queue by, preemption
weighs swapping against recomputing with, and `retry_after` promises from."""

from __future__ import annotations

from collections import deque

import numpy as np


class StepCosts:
    def __init__(self, window: int = 32, spread: int = 16):
        self.recent: deque = deque(maxlen=window)  # (tokens, seconds) of the last `window` steps
        self.spread = spread  # the least range of token counts a slope is fitted over
        self.slope = 0.0  # the last marginal cost fitted

    def record(self, tokens: int, seconds: float) -> None:
        self.recent.append((tokens, seconds))

    def seconds_per_token(self) -> float:
        """The mean cost of a token, each step's fixed cost shared among its tokens."""
        tokens = sum(t for t, _ in self.recent)
        return sum(s for _, s in self.recent) / tokens if tokens else 0.0

    def marginal_seconds_per_token(self) -> float:
        """What one more token adds to a step: the slope of step time over step tokens (a step's
        fixed cost, large for small decode steps, is not per token), fitted while the recent
        steps' token counts range over at least `spread`. Over a quiet spell of alike steps, the
        last slope fitted (0.0 before any: no evidence of a cost). At most the mean cost per
        token, which also carries the fixed costs, and never negative."""
        tokens = np.array([t for t, _ in self.recent], dtype=float)
        if len(tokens) >= 2 and np.ptp(tokens) >= self.spread:
            slope = float(np.polyfit(tokens, [s for _, s in self.recent], 1)[0])
            self.slope = min(max(slope, 0.0), self.seconds_per_token())
        return self.slope

    def throughput(self) -> float:
        """Tokens per second over the recent steps."""
        seconds = sum(s for _, s in self.recent)
        return sum(t for t, _ in self.recent) / seconds if seconds else 0.0
