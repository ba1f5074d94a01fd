"""The engine's side of load control: it feeds the signals, runs the controller (when enabled),
applies what only the engine can do (demoting ahead of need, turning away waiting requests of a
shed priority) and keeps the service-level accounting: goodput and availability.

A request is *within target* when its time to first token and its mean time between tokens
meet the SLO; goodput is such requests per second, availability their share of the submitted
ones.
"""

from __future__ import annotations

import time

from .controller import SLO, Controller, Thresholds, engine_knobs
from .request import Request
from .signals import Signals


class LoadControl:
    def __init__(self, engine, enabled: bool, slo: SLO, thresholds: Thresholds | None = None):
        self.engine, self.slo = engine, slo
        thresholds = thresholds or Thresholds()
        self.signals = Signals(thresholds.short_window, thresholds.long_window)
        self.controller = Controller(engine_knobs(engine), slo, thresholds, self._counted) if enabled else None
        self.started = time.monotonic()
        self.counts = dict.fromkeys(("requests_submitted", "requests_within_slo"), 0)
        if self.controller is not None:
            if engine.limits.ttft_target is None:  # admission triages by the target (see Admission)
                engine.limits.ttft_target = slo.ttft
            for name, knob in self.controller.knobs.items():
                engine.metrics.knobs.labels(name).set(knob.value)
            engine.metrics.controller_state.labels("normal").set(1)

    # ----------------------------------------------------------- events
    def arrival(self) -> None:
        self.counts["requests_submitted"] += 1
        self.signals.record("arrival")

    def refuses(self, priority: int) -> bool:
        """Whether a request of `priority` is refused now: its priority is shed, and it would
        queue behind a request (of its priority or above) already past its time-to-first-token
        target. The state keeps its dwell, but once the late backlog is gone nothing is turned
        away: on bench_load's trace a drained pool idled for 4 s while the overload state's
        dwell refused every retry."""
        if self.controller is None or priority >= self.controller.shed_below:
            return False
        now = time.monotonic()
        return any(self._late(r, now) and r.effective_priority >= priority for r in list(self.engine.scheduler.waiting))

    def _late(self, request: Request, now: float) -> bool:
        """Waiting past the time-to-first-token target, and not one that has streamed tokens."""
        return not request.generated and now - request.arrived > self.slo.ttft

    def finished(self, request: Request) -> None:
        if request.first_token is None:
            return
        tokens, per_token = len(request.generated), 0.0
        if tokens > 1:
            per_token = (request.last_token - request.first_token) / (tokens - 1)
            self.signals.record("per_token", per_token)
        if request.first_token - request.arrived <= self.slo.ttft and per_token <= self.slo.per_token:
            self.counts["requests_within_slo"] += 1

    # ------------------------------------------------------------- tick
    def tick(self) -> None:
        """Sample the levels and let the controller decide; then demote ahead of need and turn
        away waiting requests of a shed priority."""
        now = time.monotonic()
        engine, stats = self.engine, self.engine.pool.stats()
        total = max(stats["num_blocks"], 1)
        lookups = max(stats["lookup_tokens"], 1)
        fresh = [request.arrived for request in engine.scheduler.waiting if not request.generated]
        self.signals.sample_levels({
            "queue_depth": len(engine.scheduler.waiting),
            "oldest_wait": now - min(fresh) if fresh else 0.0,
            "kv_usage": stats["blocks_used"] / total,
            "host_usage": stats.get("host_blocks_used", 0) / max(stats.get("host_blocks", 1), 1),
            "pinned_share": stats["blocks_pinned"] / total,
            "hit_rate_device": (stats["hit_tokens_prefix"] - stats["hit_tokens_host"] - stats["hit_tokens_disk"]) / lookups,
            "hit_rate_host": stats["hit_tokens_host"] / lookups,
            "hit_rate_disk": stats["hit_tokens_disk"] / lookups,
        }, now)
        if self.controller is None or not self.controller.tick(self.signals, now):
            return
        if engine.limits.demote_ahead:
            engine.pool.make_free(int(engine.limits.demote_ahead * stats["num_blocks"]))
        for request in list(engine.scheduler.waiting):
            if request.effective_priority < self.controller.shed_below and self._late(request, now):
                engine.turn_away(request)

    def _counted(self, knob: str, value: float) -> None:
        metrics = self.engine.metrics
        metrics.controller_actions.labels(knob).inc()
        if knob == "state":
            for state in ("normal", "pressure", "overload"):
                metrics.controller_state.labels(state).set(1 if self.controller.state == state else 0)
        else:
            metrics.knobs.labels(knob).set(value)

    # ------------------------------------------------------------ stats
    def stats(self) -> dict:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        within, submitted = self.counts["requests_within_slo"], self.counts["requests_submitted"]
        settings = ({"state": "off"} if self.controller is None else
                    self.controller.settings() | {"ttft_target": self.engine.limits.ttft_target})
        return self.counts | {
            "goodput": within / elapsed,
            "availability": within / submitted if submitted else 1.0,
            "controller": settings,
        }
