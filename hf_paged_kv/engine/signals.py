"""What the load controller watches: the engine's recent history over a short and a long window.

Events (arrivals, first tokens, finished requests' per-token latency, queue waits, preemptions,
rejections) are kept with their time for the long window; each reading reports, for both
windows, rates per second, means and 95th percentiles. Levels (queue depth, how long the oldest
waiting request has waited, KV usage, pinned share, hit rates) are sampled at each reading and
smoothed with an exponential moving average per window; the last sample is also reported as it
is (`now`), for decisions that must not lag behind the queue.

    >>> signals.read(now)["short"]["ttft_p95"]
"""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np

# per_token: a finished request's mean time between tokens, as its service-level target counts it
# (single gaps are not: the one that waits out a 256-token prefill chunk breaks a 0.3 s target
# in requests whose mean is 0.06 s, and the controller shrank bench_load's budget on it)
EVENTS = ("arrival", "ttft", "per_token", "queue_wait", "preemption", "rejection")
LEVELS = ("queue_depth", "oldest_wait", "kv_usage", "host_usage", "pinned_share", "hit_rate_device", "hit_rate_host",
          "hit_rate_disk")


class Signals:
    def __init__(self, short: float = 10.0, long: float = 60.0, clock=time.monotonic):
        self.windows = {"short": short, "long": long}
        self.clock = clock
        self.events: dict[str, deque] = {name: deque() for name in EVENTS}
        self.levels = {window: dict.fromkeys(LEVELS, 0.0) for window in self.windows}
        self.last_level_time: float | None = None
        self.current = dict.fromkeys(LEVELS, 0.0)

    def record(self, event: str, value: float = 1.0, now: float | None = None) -> None:
        self.events[event].append((self.clock() if now is None else now, value))

    def sample_levels(self, values: dict[str, float], now: float | None = None) -> None:
        """Fold the current levels into each window's moving average."""
        now = self.clock() if now is None else now
        elapsed = 0.0 if self.last_level_time is None else now - self.last_level_time
        self.last_level_time = now
        self.current = {name: float(values.get(name, 0.0)) for name in LEVELS}
        for window, span in self.windows.items():
            keep = math.exp(-elapsed / span) if elapsed else 0.0
            for name in LEVELS:
                self.levels[window][name] = keep * self.levels[window][name] + (1 - keep) * values.get(name, 0.0)

    def read(self, now: float | None = None) -> dict[str, dict[str, float]]:
        """Per window: `<event>_rate` (per second), `<event>_mean`, `<event>_p95`, and the levels;
        under `now`: the levels as last sampled."""
        now = self.clock() if now is None else now
        self._forget(now)
        reading = {}
        for window, span in self.windows.items():
            values = {}
            for name, events in self.events.items():
                recent = np.array([v for t, v in events if t >= now - span], dtype=float)
                values[f"{name}_rate"] = len(recent) / span
                values[f"{name}_mean"] = float(recent.mean()) if len(recent) else 0.0
                values[f"{name}_p95"] = float(np.percentile(recent, 95)) if len(recent) else 0.0
            reading[window] = values | self.levels[window]
        reading["now"] = dict(self.current)
        return reading

    def _forget(self, now: float) -> None:
        horizon = now - max(self.windows.values())
        for events in self.events.values():
            while events and events[0][0] < horizon:
                events.popleft()
