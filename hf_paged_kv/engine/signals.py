"""What the load controller watches: the engine's recent history over a short and a long window.

Events (arrivals, first tokens, finished requests' per-token latency, queue waits, preemptions,
rejections) are kept with their time for the long window; each reading reports, for both
windows, rates per second, means and 95th percentiles. Levels (queue depth, how long the oldest
waiting request has waited, KV usage, pinned share, hit rates) are sampled at each reading and
smoothed with an exponential moving average per window; the last sample is also reported as it
is (`now`), for decisions that must not lag behind the queue. Until a window has passed since the
signals began, its rates count the time that has passed (a burst in the first seconds is not
diluted over a window that has not happened yet).

Client threads record events (arrivals, rejections) while the scheduler thread reads them: every
access holds one lock.

    >>> signals.read(now)["short"]["ttft_p95"]
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

import numpy as np

# per_token: a finished request's mean time between tokens, as its service-level target counts it
# (single gaps are not: the one that waits out a 256-token prefill chunk breaks a 0.3 s target
# in requests whose mean is 0.06 s, and the controller shrank bench_load's budget on it)
EVENTS = ("arrival", "ttft", "per_token", "queue_wait", "preemption", "rejection")
LEVELS = ("queue_depth", "oldest_wait", "queue_age_p95", "kv_usage", "host_usage", "pinned_share", "hit_rate_device", "hit_rate_host",
          "hit_rate_disk")


class Signals:
    def __init__(self, short: float = 10.0, long: float = 60.0, clock=time.monotonic):
        self.windows = {"short": short, "long": long}
        self.clock = clock
        self.started = clock()
        self.lock = threading.Lock()
        self.events: dict[str, deque] = {name: deque() for name in EVENTS}
        self.levels = {window: dict.fromkeys(LEVELS, 0.0) for window in self.windows}
        self.last_level_time: float | None = None
        self.current = dict.fromkeys(LEVELS, 0.0)

    def start(self, now: float | None = None) -> None:
        """The windows' rates count from `now`: an engine built long before it serves would
        otherwise spread its first seconds' events over time when nothing could arrive."""
        self.started = self.clock() if now is None else now

    def record(self, event: str, value: float = 1.0, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with self.lock:
            self.events[event].append((now, value))
            # forgotten here too: without a controller nothing reads, and the history would grow
            # by every request an engine ever served
            self._trim(self.events[event], now)

    def sample_levels(self, values: dict[str, float], now: float | None = None) -> None:
        """Fold the current levels into each window's moving average."""
        now = self.clock() if now is None else now
        with self.lock:
            first = self.last_level_time is None
            elapsed = 0.0 if first else max(now - self.last_level_time, 0.0)
            self.last_level_time = now
            self.current = {name: float(values.get(name, 0.0)) for name in LEVELS}
            for window, span in self.windows.items():
                keep = 0.0 if first else math.exp(-elapsed / span)  # the first sample is the average
                for name in LEVELS:
                    self.levels[window][name] = keep * self.levels[window][name] + (1 - keep) * self.current[name]

    def read(self, now: float | None = None) -> dict[str, dict[str, float]]:
        """Per window: `<event>_rate` (per second), `<event>_mean`, `<event>_p95`, and the levels;
        under `now`: the levels as last sampled."""
        now = self.clock() if now is None else now
        reading = {}
        with self.lock:
            self._forget(now)
            for window, span in self.windows.items():
                passed = min(span, max(now - self.started, 1e-3))
                values = {}
                for name in self.events:
                    recent = self._values(name, now - span)
                    values[f"{name}_rate"] = len(recent) / passed
                    values[f"{name}_mean"] = float(recent.mean()) if len(recent) else 0.0
                    values[f"{name}_p95"] = _p95(recent)
                reading[window] = values | self.levels[window]
            reading["now"] = dict(self.current)
        return reading

    def p95(self, event: str, since: float) -> tuple[float, int]:
        """`(95th percentile, count)` of the `event` values recorded since `since` (0.0 for none):
        evidence newer than a decision, which the windows' figures mix with older."""
        with self.lock:
            recent = self._values(event, since)
        return _p95(recent), len(recent)

    def count(self, event: str, since: float) -> int:
        """How many `event`s were recorded since `since`."""
        with self.lock:
            return sum(1 for t, _ in self.events[event] if t >= since)

    def _values(self, event: str, since: float) -> np.ndarray:
        return np.array([v for t, v in self.events[event] if t >= since], dtype=float)

    def _forget(self, now: float) -> None:
        for events in self.events.values():
            self._trim(events, now)

    def _trim(self, events: deque, now: float) -> None:
        """Drop the events older than the long window."""
        horizon = now - max(self.windows.values())
        while events and events[0][0] < horizon:
            events.popleft()


def _p95(values: np.ndarray) -> float:
    return float(np.percentile(values, 95)) if len(values) else 0.0
