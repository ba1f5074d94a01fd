"""The engine's side of load control: it feeds the signals, runs the controller (when enabled),
applies what only the engine can do (demoting ahead of need; naming the waiting requests of a
shed priority, which the engine turns away) and keeps the service-level accounting: goodput and
availability. It reads the engine's limits, scheduler, pool and metrics, never the engine.

A request is *within target* when its time to first token and its mean time between tokens
meet the SLO; goodput is such requests per second, availability their share of the submitted
ones.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..errors import Overloaded
from ..pool import KVPool
from .config import Limits
from .controller import SLO, STATES, Controller, Thresholds, engine_knobs
from .metrics import EngineMetrics
from .request import Request
from .scheduler import Scheduler
from .signals import Signals

log = logging.getLogger("hf_paged_kv.engine")


class LoadControl:
    def __init__(self, limits: Limits, scheduler: Scheduler, pool: KVPool, metrics: EngineMetrics, enabled: bool,
                 slo: SLO | None, thresholds: Thresholds | None = None):
        self.limits, self.scheduler, self.pool, self.metrics, self.slo = limits, scheduler, pool, metrics, slo
        thresholds = thresholds or Thresholds()
        self.signals = Signals(thresholds.short_window, thresholds.long_window)
        self.every, self.demoted = thresholds.tick, float("-inf")  # demotion ahead of need runs once per tick
        self.controller = Controller(engine_knobs(limits, pool), slo, thresholds, self._counted) if enabled else None
        self.started: float | None = None  # the engine's first start(): goodput counts from it
        self.counts = dict.fromkeys(("requests_submitted", "requests_within_slo"), 0)
        self.lookups_seen = dict.fromkeys(("lookup_tokens", "device", "host", "disk"), 0)
        self.hit_rates = dict.fromkeys(("device", "host", "disk"), 0.0)
        self.sets_burst = False  # whether `Limits.burst_batch_tokens` is the controller's to set
        if self.controller is not None:
            if limits.ttft_target is None:  # partial chunks wait for it (see scheduler), bursts (pacing)
                limits.ttft_target = slo.ttft
            if limits.per_token_target is None:  # forwards are paced (pacing)
                limits.per_token_target = slo.per_token
            # a forward may grow to give first tokens in time (pacing), up to the budget knob's bound:
            # twice its configured value, followed when a user changes that value
            self.sets_burst = limits.burst_batch_tokens is None
            self._follow_budget()
            for name, value in self.controller.settings().items():
                metrics.controller_actions.labels(name)  # a series from the start, at 0: rate() works
                if name != "state":
                    metrics.knobs.labels(name).set(value)
            self._show_state()

    def start(self) -> None:
        """The engine starts serving: goodput's clock and the signals' rates start, at the first
        start only (the counts are over the engine's life)."""
        if self.started is None:
            self.started = time.monotonic()
            self.signals.start(self.started)

    def stop(self) -> None:
        """The engine's loop ends: the controller puts every knob back (`Controller.restore`)."""
        if self.controller is not None:
            self.controller.restore()

    # ----------------------------------------------------------- events
    def admit_or_refuse(self, priority: int) -> None:
        """Count a request's arrival; raise `Overloaded` when it must be refused: the queue is at
        `max_waiting`, or its priority is shed (`refuses`). Called under the engine's submit gate,
        so concurrent clients neither lose a count nor pass `max_waiting` together."""
        self.counts["requests_submitted"] += 1
        self.signals.record("arrival")
        backlog, most = self.scheduler.backlog(), self.limits.max_waiting
        if backlog >= most:
            ahead, why = backlog - most + 1, f"{backlog} requests are waiting (max_waiting={most})"
        elif self.refuses(priority):
            ahead, why = self.staying_ahead(priority), f"overloaded: priority {priority} is shed for now"
        else:
            return
        self.metrics.rejected()
        self.signals.record("rejection")
        raise Overloaded(self.retry_after(ahead), why)

    def retry_after(self, ahead: int = 1, besides: Request | None = None) -> float:
        """An honest wait before a retry is accepted: the time `ahead` waiting requests take to be
        admitted (those that must leave the queue first) at the recent admission rate; with no
        admission lately, the work of the first `ahead` in the queue (other than `besides`, the
        request refused) over the recent throughput (5 s with no steps yet). At least 0.1 s;
        with nothing ahead, the time to the controller's next decision, which turns away the late
        requests of shed priorities that refused it (a retry before it is refused again)."""
        if ahead <= 0:
            controller = self.controller
            if controller is None or controller.last_tick is None:
                return 0.1
            return max(0.1, controller.last_tick + controller.limits.tick - time.monotonic())
        rate = self.admission_rate()
        if rate > 0:
            return max(0.1, ahead / rate)
        first = [r for r in self.scheduler.queued() if r is not besides][:ahead]  # submitted ones too
        work = sum(r.remaining + r.params.max_new_tokens for r in first)
        throughput = self.scheduler.costs.throughput()
        return max(0.1, work / throughput) if throughput > 0 else 5.0

    def refuses(self, priority: int) -> bool:
        """Whether a request of `priority` is refused now: its priority is shed, and it would
        queue behind a request (of its priority or above) already past its time-to-first-token
        target. The state keeps its dwell, but once the late backlog is gone nothing is turned
        away: on bench_load's trace a drained pool idled for 4 s while the overload state's
        dwell refused every retry."""
        if self.controller is None or priority >= self.controller.shed_below:
            return False
        return self.late_ahead(priority) > 0

    def late_ahead(self, priority: int, besides: Request | None = None) -> int:
        """Waiting requests of `priority` or above already past the time-to-first-token target
        (other than `besides`): while any wait, a shed `priority` is refused."""
        now = time.monotonic()
        return sum(1 for r in list(self.scheduler.waiting)
                   if r is not besides and self._late(r, now) and r.effective_priority >= priority)

    def staying_ahead(self, priority: int, besides: Request | None = None) -> int:
        """`late_ahead` less the late requests of shed priorities, which the next tick turns away
        at once: those a refused request of `priority` would really wait for (its retry_after)."""
        return self.late_ahead(max(priority, self.controller.shed_below), besides)

    def admission_rate(self) -> float:
        """Requests admitted per second over the short window (each admission records its wait)."""
        now = time.monotonic()
        span = self.signals.windows["short"]
        admitted = self.signals.count("queue_wait", now - span)
        return admitted / min(span, max(now - self.signals.started, 1e-3))

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
        slo = self.slo
        if slo is not None and request.first_token - request.arrived <= slo.ttft and per_token <= slo.per_token:
            self.counts["requests_within_slo"] += 1

    # ------------------------------------------------------------- tick
    def tick_guarded(self) -> list[Request]:
        """`tick` for the engine's loop: a fault in it is counted, logged once and fails no
        request: the engine goes on with the knobs as they are (and turns nobody away)."""
        try:
            return self.tick()
        except Exception:  # noqa: BLE001 - the controller adapts the service; it must not end it
            if self.metrics.controller_fault():  # counted in stats()["controller_faults"]
                log.exception("the load controller's tick failed; the engine goes on with its knobs as they are")
            return []

    def tick(self) -> list[Request]:
        """Sample the levels and let the controller decide; demote ahead of need. Returns the
        waiting requests of a shed priority already past their target, for the engine to turn
        away (`Outcomes.turn_away`)."""
        now = time.monotonic()
        waiting, stats = self.scheduler.waiting, self.pool.stats()
        total = max(stats["num_blocks"], 1)
        ages = np.array([now - request.arrived for request in waiting if not request.generated])
        self.signals.sample_levels({
            "queue_depth": len(waiting),
            "oldest_wait": float(ages.max()) if len(ages) else 0.0,
            "queue_age_p95": float(np.percentile(ages, 95)) if len(ages) else 0.0,
            "kv_usage": stats["blocks_used"] / total,
            "host_usage": stats.get("host_blocks_used", 0) / max(stats.get("host_blocks", 1), 1),
            "pinned_share": stats["blocks_pinned"] / total,
        } | {f"hit_rate_{tier}": rate for tier, rate in self._hit_rates(stats).items()}, now)
        # with or without the controller; without a host tier it would only drop cached prefixes
        if self.limits.demote_ahead and self.pool.has_host_tier and now - self.demoted >= self.every:
            self.pool.make_free(int(self.limits.demote_ahead * stats["num_blocks"]))
            self.demoted = now
        # the levels shedding steps through: those of requests it could turn away (a preempted
        # request has its first token, and its effective priority counts its preemptions)
        priorities = [request.effective_priority for request in waiting if not request.generated]
        if self.controller is None or not self.controller.tick(self.signals, now, priorities):
            return []
        self._follow_budget()
        return [request for request in waiting
                if request.effective_priority < self.controller.shed_below and self._late(request, now)]

    def _follow_budget(self) -> None:
        """The burst ceiling the controller set, at the budget knob's bound as it is now."""
        if self.sets_burst:
            self.limits.burst_batch_tokens = int(self.controller.knobs["max_batch_tokens"].high)

    def _hit_rates(self, stats: dict) -> dict[str, float]:
        """Per tier, the share of the prompt tokens looked up since the last tick that it served
        (the last shares while nothing was looked up): recent, where the pool's counters are
        lifetime totals."""
        now = {"lookup_tokens": stats["lookup_tokens"], "host": stats["hit_tokens_host"],
               "disk": stats["hit_tokens_disk"]}
        now["device"] = stats["hit_tokens_prefix"] - now["host"] - now["disk"]
        looked_up = now["lookup_tokens"] - self.lookups_seen["lookup_tokens"]
        if looked_up > 0:
            self.hit_rates = {tier: (now[tier] - self.lookups_seen[tier]) / looked_up for tier in self.hit_rates}
        self.lookups_seen = now
        return self.hit_rates

    def _show_state(self) -> None:
        for state in STATES:
            self.metrics.controller_state.labels(state).set(1 if self.controller.state == state else 0)

    def _counted(self, knob: str, value: float) -> None:
        metrics = self.metrics
        metrics.controller_actions.labels(knob).inc()
        if knob == "state":
            self._show_state()
        else:
            metrics.knobs.labels(knob).set(value)

    # ------------------------------------------------------------ stats
    def stats(self) -> dict:
        elapsed = max(time.monotonic() - self.started, 1e-9) if self.started is not None else float("inf")
        within, submitted = self.counts["requests_within_slo"], self.counts["requests_submitted"]
        settings = ({"state": "off"} if self.controller is None else
                    self.controller.settings() | {"ttft_target": self.limits.ttft_target,
                                                 "per_token_target": self.limits.per_token_target,
                                                 "burst_batch_tokens": self.limits.burst_batch_tokens})
        if self.slo is None:  # no targets: nothing to be within
            return self.counts | {"goodput": None, "availability": None, "controller": settings}
        return self.counts | {
            "goodput": within / elapsed,
            "availability": within / submitted if submitted else 1.0,
            "controller": settings,
        }
