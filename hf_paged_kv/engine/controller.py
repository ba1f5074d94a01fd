"""The load controller: watches the engine's signals and retunes it as load rises and falls.

Three states, entered and left on thresholds with hysteresis and a minimum dwell so it never
flaps:

- **normal**: every knob at its configured value;
- **pressure** (KV memory nearly full, or preemptions; a late first token alone is not memory
  pressure, and these moves would only lengthen its queue):
  admissions keep a watermark of the pool free and reserve more for growth, pins give way
  (smaller pin budget, higher hot threshold; they come back after), the decay half-life shortens
  so cold prefixes leave sooner, and cold cached blocks are demoted to the host tier ahead of
  need (each only tightens what was configured); left when memory is calm in
  both windows;
- **overload** (requests waited far longer than the target, admitted lately or still waiting,
  and the queue still holds late ones):
  all of the above, and the lowest priorities are shed – waiting ones past their target turned
  away, and new ones refused while requests of their priority or above wait late, each with an
  honest `retry_after` – raising the shed level through the waiting priorities, one per dwell,
  never to the highest of them while a lower one waits.

Independently of the state, the batch token budget shrinks when the per-token latency of
finished requests (p95 of each one's mean time between tokens, as its target counts it) breaks
the target, once per new evidence; once the slow requests behind a shrink have left the window
it grows while there is a queue and both per-token latency and time to first token have
headroom; under a queue it comes back up to its configured value once per-token latency has
headroom again, and down to it once first tokens use most of their target; with no queue it
returns to it. Every knob is bounded, every change is logged and counted
(`controller_actions_total{knob=...}`), and the current values are in `engine.stats()` and the
metrics. A value set from outside while the engine runs (`engine.limits.watermark = ...`)
becomes that knob's configured value; the pool's knobs keep the KVPool's arguments. When the
engine stops, every knob returns to its configured value (the pool's knobs serve `generate`
and later engines too).

With the controller, the engine also admits by the time-to-first-token target
(`Limits.ttft_target`, set to `SLO.ttft` unless given): a forward that already ends prompts
starts no other with a partial chunk that would delay their first tokens by more than a tenth of
the target. It also sets `Limits.per_token_target` from `SLO.per_token`: forwards that carry
decodes hold only the prompt tokens those decodes can afford against the target, unless only one
whole forward gives the prompts in line their first tokens in time; there a forward may also
pass the batch budget, up to `Limits.burst_batch_tokens`, which it sets to twice the budget's
configured value (`pacing`).

    >>> Engine(model, pool=pool, controller=True, slo=SLO(ttft=2.0, per_token=0.25))
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

from .config import SLO, Limits
from .signals import Signals

log = logging.getLogger("hf_paged_kv.controller")
STATES = ("normal", "pressure", "overload")
BUDGET_CEILING = 2  # the batch token budget grows to this multiple of its configured value; bursts reach it


@dataclass
class Thresholds:
    kv_high: float = 0.90  # enter pressure above this KV usage (short window)
    kv_low: float = 0.75  # leave pressure below this (both windows)
    # enter overload when the p95 queue wait exceeds this many TTFT targets and the oldest waiting
    # request is already past the target. High on purpose: a shed request misses its target for
    # certain (its retries count), so shedding pays only when the queue is far behind, not in a
    # burst that drains within a few targets (2x shed 45 of 99 requests of bench_load's trace and
    # cost 12 points of availability)
    overload_wait: float = 6.0
    recover_wait: float = 0.5  # leave overload once the oldest waiting request has waited less than this
    dwell: float = 5.0  # seconds a state is kept at least
    tick: float = 0.5  # seconds between decisions
    short_window: float = 10.0  # seconds the short averages cover
    long_window: float = 60.0  # seconds the long averages cover

    def __post_init__(self):
        positive = ("overload_wait", "short_window", "long_window")
        wrong = [f"{name}={getattr(self, name)} (must be > 0)" for name in positive if not getattr(self, name) > 0]
        wrong += [f"{name}={getattr(self, name)} (must be >= 0)" for name in ("dwell", "tick")
                  if not getattr(self, name) >= 0]
        if not 0 <= self.kv_low <= self.kv_high <= 1:
            wrong.append(f"0 <= kv_low ({self.kv_low}) <= kv_high ({self.kv_high}) <= 1 does not hold")
        if not 0 <= self.recover_wait < self.overload_wait:
            wrong.append(f"recover_wait ({self.recover_wait}) must be >= 0 and below overload_wait "
                         f"({self.overload_wait})")
        if self.short_window > self.long_window:
            wrong.append(f"short_window ({self.short_window}) is longer than long_window ({self.long_window})")
        if wrong:
            raise ValueError("invalid Thresholds: " + "; ".join(wrong))


@dataclass
class Knob:
    """One actuator: its value per state (a state without one leaves the knob to a rule),
    bounds, and how to apply a value. With `read` (the live value) and `derive` (a configured
    value's targets and bounds), a value someone else set since the controller's last move
    becomes the configured one (`follow_user`)."""

    name: str
    value: float  # applied now
    targets: dict[str, float]
    low: float
    high: float
    apply: Callable[[float], None]
    read: Callable[[], float] | None = None
    derive: Callable[[float], tuple[dict[str, float], float, float]] | None = None

    def __post_init__(self):
        self.configured = self.value  # where the normal state and a stopping engine leave it

    def move_to(self, value: float) -> bool:
        value = min(self.high, max(self.low, value))
        if value == self.value:
            return False
        self.value = value
        self.apply(value)
        return True

    def follow_user(self) -> bool:
        """Adopt a live value the controller did not set as the configured one (its targets and
        bounds follow); True when there was one."""
        if self.read is None or (live := self.read()) == self.value:
            return False
        self.value = self.configured = live
        self.targets, self.low, self.high = self.derive(live)
        return True


class Controller:
    def __init__(self, knobs: list[Knob], slo: SLO, thresholds: Thresholds | None = None,
                 on_action: Callable[[str, float], None] = lambda knob, value: None):
        self.knobs = {k.name: k for k in knobs}
        self.slo, self.limits = slo, thresholds or Thresholds()
        self.on_action = on_action
        self.state, self.entered, self.last_tick = "normal", None, None
        self.shed_below = float("-inf")  # priorities below this are refused while overloaded
        self.shed_since: float | None = None
        self.seen: set[int] = set()  # the priorities waiting since overload began
        self.budget_moved = self.budget_shrunk = float("-inf")

    def tick(self, signals: Signals, now: float, priorities=()) -> bool:
        """Read the signals and move the knobs; True when it decided (once per `tick` seconds).
        `priorities`: those of the requests waiting now (the levels shedding steps through)."""
        if self.last_tick is not None and now - self.last_tick < self.limits.tick:
            return False
        self.last_tick = now
        if self.entered is None:
            self.entered = now
        reading = signals.read(now)
        self._follow_users()
        self._transition(reading["short"], reading["long"], reading["now"], now)
        for knob in self.knobs.values():
            target = knob.targets.get(self.state)
            if target is not None and knob.move_to(target):
                self._act(knob.name, knob.value)
        self._batch_budget(signals, reading["short"], reading["now"], now)
        self._shedding(now, priorities)
        return True

    def restore(self) -> None:
        """Every knob back at its configured value, the state normal and nothing shed: the engine
        stops, and the pool's knobs (pin budget, hot threshold, half-life) serve `generate` and
        later engines, which would read tightened values as configured."""
        self._follow_users()
        for knob in self.knobs.values():
            if knob.move_to(knob.configured):
                self._act(knob.name, knob.value)
        if self.state != "normal":
            self.state, self.entered = "normal", None
            self._act("state", STATES.index("normal"))
        self._shedding(0.0, ())

    def _follow_users(self) -> None:
        for knob in self.knobs.values():
            if knob.follow_user():
                log.info("controller: %s set to %s from outside: its configured value now", knob.name, knob.value)

    # ------------------------------------------------------------- states
    def _transition(self, short: dict, long: dict, current: dict, now: float) -> None:
        if now - self.entered < self.limits.dwell:
            return
        # pressure is about memory: its moves (a watermark, a larger growth reserve, fewer pins)
        # admit fewer requests and recompute more prefixes, which lengthens a queue that compute
        # caused. With late first tokens also entering it, bench_load's controlled engine lost to
        # the uncontrolled one (d328d70: 78.8% vs 81.8% of requests within their targets)
        pressure = short["kv_usage"] > self.limits.kv_high or short["preemption_rate"] > 0
        # both windows: the long average alone lags a pool that filled after a calm spell, and
        # pressure would be left while memory is still full
        calm = max(short["kv_usage"], long["kv_usage"]) < self.limits.kv_low and short["preemption_rate"] == 0
        # the waits of admitted requests lag the queue by their whole wait: shedding on them alone
        # turns requests away after the burst has drained, so the live queue must agree. And the
        # requests still waiting count as well as those admitted: with nothing admitted (a stall),
        # or a priority starved while others are admitted, no late wait is ever recorded
        waits = max(short["queue_wait_p95"], current["queue_age_p95"])
        overloaded = waits > self.limits.overload_wait * self.slo.ttft and current["oldest_wait"] > self.slo.ttft
        recovered = current["oldest_wait"] < self.limits.recover_wait * self.slo.ttft
        state = self.state
        if state != "overload" and overloaded:
            state = "overload"
        elif state == "overload" and recovered:
            state = "pressure"
        elif state == "normal" and pressure:
            state = "pressure"
        elif state == "pressure" and calm:
            state = "normal"
        if state != self.state:
            log.info("controller: %s -> %s (kv %.2f, queue wait p95 %.2fs, ttft p95 %.2fs)", self.state, state,
                     short["kv_usage"], short["queue_wait_p95"], short["ttft_p95"])
            self.state, self.entered = state, now
            self._act("state", STATES.index(state))

    # -------------------------------------------------------------- rules
    def _batch_budget(self, signals: Signals, short: dict, current: dict, now: float) -> None:
        """Shrink the token budget when per-token latency breaks its target. While requests queue,
        grow it when both latencies have headroom (past the configured budget too), else bring it
        back toward the configured budget: up once per-token latency has headroom again (a shrunk
        budget under a standing queue only lengthens it), down once first tokens use most of
        their target; with no queue, return to the configured budget.

        A shrink needs the window's p95 over the target and evidence newer than the last move
        (the window still holds what that move answered: read again, one slow request took the
        budget to its floor in 2 s); nothing grows back until that evidence has left the window.
        First tokens have no headroom to grow when their p95 or the oldest waiting request has
        used half the target: a larger forward delays every first token in it, and in a burst the
        short prompts admitted first would wait for the long ones (on bench_load's trace the
        budget doubled in a burst's first seconds and its shortest prompts got their first tokens
        together with the longest)."""
        knob = self.knobs.get("max_batch_tokens")
        if knob is None:
            return
        window, configured = signals.windows["short"], knob.configured
        fresh, count = signals.p95("per_token", max(now - window, self.budget_moved))
        slow = short["per_token_p95"] > self.slo.per_token
        if slow and count and fresh > self.slo.per_token:
            value = knob.value * 0.75
            self.budget_shrunk = now
        elif now - self.budget_shrunk < window:  # what made it shrink is still in the window
            return
        elif current["queue_depth"] >= 1:
            tokens_room = short["per_token_p95"] < 0.7 * self.slo.per_token
            first_used = max(short["ttft_p95"], current["oldest_wait"]) / self.slo.ttft
            if tokens_room and first_used < 0.5:
                value = knob.value * 1.25
            elif tokens_room and knob.value < configured:
                value = min(knob.value * 1.25, configured)
            elif first_used > 0.8 and knob.value > configured:  # between 0.5 and 0.8 it holds: no flapping
                value = max(knob.value * 0.75, configured)
            else:
                return
        elif knob.value != configured and not slow:
            step = 1.25 if knob.value < configured else 0.75
            value = (min if step > 1 else max)(knob.value * step, configured)
        else:
            return
        # rounded away from the current value: a budget of 2 grows (round(2 x 1.25) would stay 2)
        if knob.move_to(math.ceil(value) if value > knob.value else math.floor(value)):
            self.budget_moved = now
            self._act(knob.name, knob.value)

    def _shedding(self, now: float, priorities) -> None:
        """In overload, refuse the lowest priority waiting; one more priority level per dwell it
        lasts, stepping through the priorities that have waited since it began. The highest of
        them is never shed while there is a lower one (with a single priority, it is the lowest)."""
        if self.state != "overload":
            self.seen = set()
            if self.shed_below != float("-inf"):
                self.shed_below, self.shed_since = float("-inf"), None
                self._act("shed_below_priority", self.shed_below)
            return
        self.seen |= set(priorities) or {0}
        levels = sorted(self.seen)
        sheddable = levels[:-1] if len(levels) > 1 else levels
        if self.shed_since is None:
            level = sheddable[0] + 1
        elif now - self.shed_since >= self.limits.dwell:
            higher = [p for p in sheddable if p >= self.shed_below]
            if not higher:
                return
            level = higher[0] + 1
        else:
            return
        self.shed_below, self.shed_since = level, now
        self._act("shed_below_priority", self.shed_below)

    def _act(self, knob: str, value: float) -> None:
        log.info("controller: %s = %s (state %s)", knob, value, self.state)
        self.on_action(knob, value)

    def settings(self) -> dict[str, float]:
        return {name: knob.value for name, knob in self.knobs.items()} | {
            "state": self.state, "shed_below_priority": self.shed_below}


def engine_knobs(limits: Limits, pool) -> list[Knob]:
    """The actuators of an engine (its `limits`) and its pool. Each starts at its configured value
    and returns to it in the normal state; pressure and overload only tighten (a watermark
    configured above pressure's keeps its own), and every bound includes the configured value. The
    engine's own knobs read their live value, so a change made from outside becomes the configured
    value; the pool's (pin budget, hot threshold, half-life: `KVPool.tune`) are configured by the
    KVPool's arguments, which every engine on the pool reads alike: a value another engine's
    controller set is never taken for a configured one (two engines would tighten each other's)."""
    options = pool.options

    def knob(name, attribute, derive, cast=float):  # one of `limits`: follows changes made from outside
        targets, low, high = derive(getattr(limits, attribute))
        return Knob(name, getattr(limits, attribute), targets, low, high,
                    lambda v: setattr(limits, attribute, cast(v)), lambda: getattr(limits, attribute), derive)

    def pool_knob(name, derive):  # one of the pool's: configured by the KVPool's argument
        targets, low, high = derive(options[name])
        return Knob(name, options[name], targets, low, high, lambda v: pool.tune(**{name: float(v)}), None, derive)

    def tightening(pressure, overload, high):
        return lambda c: ({"normal": c, "pressure": max(c, pressure), "overload": max(c, overload)}, 0.0, max(high, c))

    def scaled(pressure, overload, low, high):  # targets and bounds as multiples of the configured value
        return lambda c: ({"normal": c, "pressure": c * pressure, "overload": c * overload}, c * low, c * high)

    knobs = [
        knob("watermark", "watermark", tightening(0.05, 0.10, 0.3)),
        knob("growth_reserve", "growth_ratio_min", tightening(0.3, 0.5, 1.0)),
        knob("max_batch_tokens", "max_batch_tokens", lambda c: ({}, min(c, max(16, c // 4)), c * BUDGET_CEILING), int),
        pool_knob("pin_budget", lambda c: ({"normal": c, "pressure": c / 2, "overload": c / 4}, 0.0, 1.0)),
        pool_knob("half_life", scaled(1 / 4, 1 / 4, 1 / 16, 1.0)),
    ]
    if options["hot_threshold"] is not None:
        knobs.append(pool_knob("hot_threshold", scaled(2, 4, 1, 8)))
    if pool.has_host_tier:
        knobs.append(knob("demote_ahead", "demote_ahead", tightening(0.10, 0.15, 0.5)))
    return knobs
