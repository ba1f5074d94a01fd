"""What the engine's recent steps cost: the figures admission orders the queue by, preemption
weighs swapping against recomputing with, and `retry_after` promises from. The scheduler thread
records; client threads read (`retry_after`), so every access holds a lock."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

MOST_TOKENS = 2**40  # more than any step holds: `tokens_within`'s answer for longer times


class StepCosts:
    def __init__(self, window: int = 32, spread: int = 16):
        self.recent: deque = deque(maxlen=window)  # (tokens, seconds) of the last `window` steps
        self.spread = spread  # the least range of token counts a slope is fitted over
        self.slope = 0.0  # the last marginal cost fitted
        self.lock = threading.Lock()

    def record(self, tokens: int, seconds: float) -> None:
        with self.lock:
            self.recent.append((tokens, seconds))

    def steps(self) -> list[tuple[int, float]]:
        """A copy of the recent `(tokens, seconds)`."""
        with self.lock:
            return list(self.recent)

    def seconds_per_token(self) -> float:
        """The mean cost of a token, each step's fixed cost shared among its tokens."""
        steps = self.steps()
        tokens = sum(t for t, _ in steps)
        return sum(s for _, s in steps) / tokens if tokens else 0.0

    def marginal_seconds_per_token(self) -> float:
        """What one more token adds to a step: the slope of step time over step tokens (a step's
        fixed cost, large for small decode steps, is not per token), fitted while the recent
        steps' token counts range over at least `spread`. Over a quiet spell of alike steps, the
        last slope fitted (0.0 before any: no evidence of a cost). At most the mean cost per
        token, which also carries the fixed costs, and never negative."""
        steps = self.steps()
        tokens = np.array([t for t, _ in steps], dtype=float)
        if len(tokens) >= 2 and np.ptp(tokens) >= self.spread:
            slope = float(np.polyfit(tokens, [s for _, s in steps], 1)[0])
            self.slope = min(max(slope, 0.0), self.seconds_per_token())
        return self.slope

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens one step can hold and still take at most `seconds`, on the line of
        slope `marginal_seconds_per_token` through the recent steps' mean (its intercept is the
        fixed cost of a step); with no slope fitted (alike steps, or a flat fit), the mean cost
        per token, which overestimates no step at least as large as the mean. None before any
        step. May be 0 or less: the fixed cost alone takes longer; at most `MOST_TOKENS` (a huge
        target does not overflow)."""
        slope, steps = self.marginal_seconds_per_token(), self.steps()
        if not steps:
            return None
        mean_tokens, mean_seconds = np.mean(steps, axis=0)
        slope = slope if slope > 0.0 else mean_seconds / mean_tokens  # the mean cost per token
        if slope <= 0.0:
            return None
        within = seconds - max(0.0, mean_seconds - slope * mean_tokens)
        return MOST_TOKENS if within >= MOST_TOKENS * slope else int(within / slope)

    def step_seconds(self) -> float:
        """The mean duration of the recent steps (0.0 before any)."""
        steps = self.steps()
        return sum(s for _, s in steps) / len(steps) if steps else 0.0

    def throughput(self) -> float:
        """Tokens per second over the recent steps."""
        steps = self.steps()
        seconds = sum(s for _, s in steps)
        return sum(t for t, _ in steps) / seconds if seconds else 0.0
