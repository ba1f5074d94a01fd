"""The load controller: its state machine on synthetic signals (hysteresis, dwell, bounds, every
actuator moves and comes back), and an engine under a scripted burst that sheds and recovers."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import VOCAB, assert_pool_clean, make_model

import hf_paged_kv
from hf_paged_kv import Engine, KVPool, Overloaded
from hf_paged_kv.engine import SLO, Limits, Thresholds
from hf_paged_kv.engine.controller import Controller, Knob
from hf_paged_kv.engine.request import Request, SamplingParams
from hf_paged_kv.engine.signals import Signals

CALM = dict(kv_usage=0.2, queue_depth=0)
FULL = dict(kv_usage=0.97, queue_depth=3)
LATE = FULL | dict(oldest_wait=5.0)  # the queue holds requests past the TTFT target now


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def setup(**thresholds):
    clock = Clock()
    signals = Signals(short=2.0, long=4.0, clock=clock)
    applied = []
    knobs = [Knob("watermark", 0.0, {"normal": 0.0, "pressure": 0.05, "overload": 0.1}, 0.0, 0.08,
                  lambda v: applied.append(("watermark", v))),
             Knob("max_batch_tokens", 256, {}, 64, 512, lambda v: applied.append(("max_batch_tokens", v)))]
    actions = []
    controller = Controller(knobs, SLO(ttft=1.0, per_token=0.1), Thresholds(**dict(dwell=3.0, tick=0.5, overload_wait=2.0) | thresholds),
                            on_action=lambda knob, value: actions.append((knob, value)))
    return clock, signals, controller, applied, actions


def run(clock, signals, controller, levels, seconds, events=(), priorities=(0,)):
    """Advance the clock in ticks, feeding levels (and events) each tick; `priorities`: those of
    the requests waiting."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now += 0.5
        for name, value in events:
            signals.record(name, value, clock.now)
        signals.sample_levels(levels, clock.now)
        controller.tick(signals, clock.now, priorities)


def into_pressure(controller, signals, now: float) -> float:
    """Three seconds of a full pool and preemptions, a tick each: pressure (dwell 0)."""
    for _ in range(3):
        now += 1.0
        signals.sample_levels(FULL, now)
        signals.record("preemption", 1.0, now)
        controller.tick(signals, now)
    return now


def calm_down(controller, signals, now: float) -> float:
    """80 calm seconds, a tick each: long enough for both windows to leave pressure."""
    for _ in range(80):
        now += 1.0
        signals.sample_levels(CALM, now)
        controller.tick(signals, now)
    return now


def test_pressure_is_entered_and_left_with_hysteresis_and_dwell():
    clock, signals, controller, applied, actions = setup()
    run(clock, signals, controller, CALM, 4)
    assert controller.state == "normal"
    run(clock, signals, controller, FULL, 8)  # the short window's average needs a few seconds to pass 0.9
    assert controller.state == "pressure"
    assert ("watermark", 0.05) in applied
    # between the thresholds (above kv_low, below kv_high): neither entry nor exit, no flapping
    transitions = sum(1 for knob, _ in actions if knob == "state")
    run(clock, signals, controller, dict(kv_usage=0.8, queue_depth=0), 20)
    assert controller.state == "pressure" and sum(1 for k, _ in actions if k == "state") == transitions
    run(clock, signals, controller, CALM, 20)
    assert controller.state == "normal" and applied[-1] == ("watermark", 0.0)  # the actuator came back


def test_late_first_tokens_with_memory_to_spare_are_not_pressure():
    """Pressure's moves admit fewer requests and recompute more: they would lengthen a queue
    that compute caused, so late first tokens alone leave the knobs where they are."""
    clock, signals, controller, applied, _ = setup()
    run(clock, signals, controller, CALM, 12, events=[("ttft", 3.0)])
    assert controller.state == "normal" and ("watermark", 0.05) not in applied
    run(clock, signals, controller, CALM, 8, events=[("ttft", 3.0), ("preemption", 1.0)])
    assert controller.state == "pressure"


def test_a_brief_spike_inside_the_dwell_changes_nothing():
    clock, signals, controller, _, actions = setup()
    run(clock, signals, controller, FULL, 8)
    assert controller.state == "pressure"
    entered = clock.now
    run(clock, signals, controller, CALM, 1.0)  # calm again, but within the dwell: stays
    assert controller.state == "pressure" and clock.now - entered < 3.0


def test_overload_sheds_one_waiting_priority_per_dwell_and_recovers():
    """Shedding starts at the lowest priority waiting and steps, one per dwell, through the
    priorities that wait (not through unused levels); the highest of them is never shed."""
    clock, signals, controller, applied, actions = setup()
    waiting = (0, 0, 3, 5)
    run(clock, signals, controller, LATE, 4, events=[("queue_wait", 5.0)], priorities=waiting)
    assert controller.state == "overload"
    assert controller.shed_below == 1 and ("watermark", 0.08) in applied  # bounded: 0.1 clamped to 0.08
    run(clock, signals, controller, LATE, 3.5, events=[("queue_wait", 5.0)], priorities=waiting)
    assert controller.shed_below == 4
    run(clock, signals, controller, LATE, 12, events=[("queue_wait", 5.0)], priorities=waiting)
    assert controller.shed_below == 4  # priority 5 is served
    run(clock, signals, controller, CALM, 30)
    assert controller.state == "normal" and controller.shed_below == float("-inf")
    sheds = [value for knob, value in actions if knob == "shed_below_priority"]
    assert sheds == [1, 4, float("-inf")]  # one level per dwell, cleared on recovery


def test_an_admission_stall_reaches_overload():
    """Waits are recorded when requests are admitted: when nothing is admitted, the ages of the
    requests waiting must still say that the queue is far behind."""
    clock, signals, controller, _, _ = setup()
    run(clock, signals, controller, FULL | dict(oldest_wait=1.5, queue_age_p95=1.5), 6)
    assert controller.state != "overload"  # late, but not yet far behind
    run(clock, signals, controller, FULL | dict(oldest_wait=2.5, queue_age_p95=2.5), 4)  # no admission, no wait event
    assert controller.state == "overload" and controller.shed_below == 1


def test_pressure_holds_while_memory_stays_full_after_a_calm_spell():
    """Pressure is left only when both windows are calm: the long average still low from the
    calm spell must not end it while the pool is full."""
    clock, signals, controller, _, actions = setup(dwell=1.0)
    signals.windows["long"] = 60.0
    run(clock, signals, controller, CALM, 120)
    run(clock, signals, controller, FULL, 60)
    assert controller.state == "pressure"
    assert sum(1 for knob, _ in actions if knob == "state") == 1


def test_batch_budget_does_not_grow_while_first_tokens_have_no_headroom():
    """A larger forward delays every first token in it: with a queue and per-token headroom,
    the budget stays while the p95 time to first token or the oldest wait has used half the
    target; once first tokens are quick and nothing waits long, it grows."""
    clock, signals, controller, applied, _ = setup()
    queued = dict(kv_usage=0.2, queue_depth=4)
    run(clock, signals, controller, queued, 6, events=[("per_token", 0.01), ("ttft", 0.6)])  # target 1.0 s
    run(clock, signals, controller, queued | dict(oldest_wait=0.6), 6, events=[("per_token", 0.01), ("ttft", 0.1)])
    assert controller.knobs["max_batch_tokens"].value == 256 and not [a for a in applied if a[0] == "max_batch_tokens"]
    run(clock, signals, controller, queued, 6, events=[("per_token", 0.01), ("ttft", 0.1)])
    assert controller.knobs["max_batch_tokens"].value > 256


def test_a_shed_priority_is_refused_only_while_late_requests_wait():
    """Overload's dwell outlasts its backlog: a shed priority is refused while a request waits
    past its first-token target, and accepted again once none does, though the state stays."""
    model = make_model("llama", seed=3)
    engine = Engine(model, pool=KVPool(num_blocks=32, block_size=8), slo=SLO(ttft=0.5, per_token=1.0))
    engine.accepting = True  # accept without running the loop: the queue is what the test puts in it
    controller = engine.load.controller
    controller.state, controller.shed_below = "overload", 1
    engine.submit([5, 6, 7], max_new_tokens=2)  # no late request waits: accepted
    late_lower = Request([4, 5, 6], SamplingParams(max_new_tokens=2), priority=-1, arrived=time.monotonic() - 2.0)
    engine.scheduler.add(late_lower)
    engine.submit([5, 6, 7], max_new_tokens=2)  # only a lower priority is late: it would not queue behind it
    late = Request([8, 9, 10], SamplingParams(max_new_tokens=2), arrived=time.monotonic() - 2.0)
    engine.scheduler.add(late)
    with pytest.raises(Overloaded):
        engine.submit([5, 6, 7], max_new_tokens=2)
    engine.submit([5, 6, 7], max_new_tokens=2, priority=1)  # not a shed priority
    engine.scheduler.finish(late, "cancelled")
    engine.scheduler.finish(late_lower, "cancelled")
    engine.submit([5, 6, 7], max_new_tokens=2)  # the late backlog is gone: accepted again
    assert controller.state == "overload" and engine.stats()["requests_rejected"] == 1
    controller.state, controller.shed_below = "normal", float("-inf")  # serve what was accepted
    engine.start()
    engine.stop(drain=True)
    assert engine.stats()["requests_finished"] == 4
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


def test_long_past_waits_with_a_drained_queue_shed_nothing():
    """Admitted requests report their waits when they start, so the waits of a burst arrive
    after its queue has gone: without late requests waiting now, nothing is shed, and once
    the queue drains, overload ends at the next decision past its dwell."""
    clock, signals, controller, _, actions = setup()
    run(clock, signals, controller, FULL, 6, events=[("queue_wait", 5.0)])
    assert controller.state != "overload" and controller.shed_below == float("-inf")
    run(clock, signals, controller, LATE, 4, events=[("queue_wait", 5.0)])
    assert controller.state == "overload"
    entered = clock.now
    run(clock, signals, controller, FULL, 3.5, events=[("queue_wait", 5.0)])  # drained, waits still reported
    assert controller.state == "pressure" and clock.now - entered < 4.5
    assert controller.shed_below == float("-inf")


def test_batch_budget_shrinks_on_slow_tokens_and_grows_back_with_a_queue():
    clock, signals, controller, applied, _ = setup()
    run(clock, signals, controller, CALM, 4, events=[("per_token", 0.5)])
    shrunk = controller.knobs["max_batch_tokens"].value
    assert 64 <= shrunk < 256
    run(clock, signals, controller, dict(kv_usage=0.2, queue_depth=4), 20, events=[("per_token", 0.01)])
    assert controller.knobs["max_batch_tokens"].value > shrunk and controller.knobs["max_batch_tokens"].value <= 512


def test_one_slow_request_shrinks_the_budget_once_and_an_idle_engine_returns_to_the_configured_budget():
    """The window keeps a slow request for its whole span; reacting to it again at every
    decision took the budget to its floor in 2 s. A shrink needs new evidence; with no queue
    the budget goes back to what was configured."""
    clock, signals, controller, _, _ = setup()
    clock.now += 0.5
    signals.record("per_token", 0.5, clock.now)  # one request 5x over its target
    run(clock, signals, controller, CALM, 1.5)  # three decisions while it is in the 2 s window
    assert controller.knobs["max_batch_tokens"].value == 192  # one step of 0.75, not 108
    run(clock, signals, controller, CALM, 1.5, events=[("per_token", 0.5)])
    assert controller.knobs["max_batch_tokens"].value < 192  # new slow requests: it shrinks again
    run(clock, signals, controller, CALM, 20)  # idle: the slow ones leave the window, the budget comes back
    assert controller.knobs["max_batch_tokens"].value == 256
    run(clock, signals, controller, dict(kv_usage=0.2, queue_depth=4), 10, events=[("per_token", 0.01)])
    assert controller.knobs["max_batch_tokens"].value > 256  # grown with a queue ...
    run(clock, signals, controller, CALM, 10, events=[("per_token", 0.01)])
    assert controller.knobs["max_batch_tokens"].value == 256  # ... and back once it has gone


def test_one_slow_request_among_many_fast_ones_does_not_move_the_budget():
    """The p95 of what came since the last move can be one request; the window's says whether
    per-token latency breaks its target. And after a shrink nothing grows back before the
    evidence behind it has left the window (else it flapped: shrink, grow, shrink)."""
    clock, signals, controller, _, _ = setup()
    queued, budget = dict(kv_usage=0.2, queue_depth=4), controller.knobs["max_batch_tokens"]
    run(clock, signals, controller, queued, 1.0, events=[("per_token", 0.01)] * 20)
    run(clock, signals, controller, queued, 0.5)  # a move with no evidence at its time
    grown = budget.value
    signals.record("per_token", 0.5, clock.now + 0.1)  # the only evidence since: 5x the target
    run(clock, signals, controller, queued, 0.5)
    assert budget.value >= grown  # one of 41 in the window: not a broken target
    for _ in range(10):
        signals.record("per_token", 0.5, clock.now)  # a fifth of the window now: broken
    run(clock, signals, controller, queued, 0.5)
    shrunk = budget.value
    assert 64 < shrunk < grown
    run(clock, signals, controller, queued, 1.5, events=[("per_token", 0.01)] * 100)  # headroom again ...
    assert budget.value == shrunk  # ... but the slow ones are still in the window
    run(clock, signals, controller, queued, 1.0, events=[("per_token", 0.01)] * 100)
    assert budget.value > shrunk  # they have left it


def test_a_starved_priority_is_overload_and_one_starved_request_is_not():
    """The waits of the requests still waiting count as well as those of the admitted ones: a
    priority starved while others are admitted puts the engine in overload, so that it is shed
    with a retry_after; one request passed by the rest (the p95 of the waiting ages stays low)
    does not."""
    clock, signals, controller, _, _ = setup()
    run(clock, signals, controller, FULL | dict(oldest_wait=5.0, queue_age_p95=0.3), 8, events=[("queue_wait", 0.2)])
    assert controller.state != "overload"
    run(clock, signals, controller, FULL | dict(oldest_wait=5.0, queue_age_p95=4.0), 4, events=[("queue_wait", 0.2)])
    assert controller.state == "overload"


def test_knobs_start_and_end_at_their_configured_values_and_pressure_only_tightens():
    model = make_model("llama", seed=1)
    pool = KVPool(num_blocks=64, block_size=8, host_blocks=8)
    configured = Limits(watermark=0.5, growth_ratio_min=0.6, demote_ahead=0.2, max_batch_tokens=8)
    engine = Engine(model, pool=pool, limits=configured, slo=SLO(per_token=0.1),
                    thresholds=Thresholds(dwell=0.0, tick=0.0))
    controller, signals, limits = engine.load.controller, engine.load.signals, engine.limits
    knobs = ("watermark", "growth_ratio_min", "demote_ahead")
    before = {name: getattr(limits, name) for name in knobs}
    now = time.monotonic()
    for levels, events, seconds, state in ((CALM, (), 3, "normal"), (FULL, ("preemption",), 3, "pressure"),
                                           (CALM, (), 80, "normal")):
        for _ in range(seconds):
            now += 1.0
            for event in events:
                signals.record(event, 1.0, now)
            signals.sample_levels(levels, now)
            controller.tick(signals, now)
        assert controller.state == state
        if state == "pressure":  # each tightened or kept, never loosened
            assert limits.watermark == 0.5 and limits.growth_ratio_min == 0.6 and limits.demote_ahead == 0.2
        else:
            assert {name: getattr(limits, name) for name in knobs} == before
    signals.record("per_token", 1.0, now + 1)  # 10x the per-token target: a budget of 8 must not grow
    controller.tick(signals, now + 1)
    assert limits.max_batch_tokens == 8 and controller.knobs["max_batch_tokens"].low == 8
    hf_paged_kv.disable(model)


def test_signals_survive_client_threads_recording_while_the_engine_reads():
    """`submit` records arrivals and rejections on the clients' threads while the scheduler
    thread reads the same events: unguarded, most reads of this test raised 'deque mutated
    during iteration' and killed the engine's thread."""
    import sys
    import threading

    signals = Signals(short=10.0, long=60.0)
    done, errors = threading.Event(), []

    def clients():
        while not done.is_set():
            signals.record("arrival")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=clients) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for _ in range(100):
            try:
                signals.read()
            except RuntimeError as error:
                errors.append(error)
    finally:
        done.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(interval)
    assert not errors


def test_retry_after_is_the_time_the_requests_ahead_take_to_be_admitted():
    model = make_model("llama", seed=6)
    engine = Engine(model, pool=KVPool(num_blocks=32, block_size=8), max_waiting=2)
    assert engine.load.retry_after() == 5.0  # nothing measured yet: a fixed guess
    now = time.monotonic()
    for i in range(20):  # 20 admissions in the last 5 s: 2 per second over the short window of 10 s
        engine.load.signals.record("queue_wait", 0.1, now - 5 + i * 0.25)
    engine.load.signals.started = now - 60
    assert engine.load.retry_after(1) == pytest.approx(0.5, rel=0.05)
    assert engine.load.retry_after(4) == pytest.approx(2.0, rel=0.05)
    engine.accepting = True  # accept without running the loop, so the queue fills
    for prompt in ([5, 6, 7], [5, 6, 8]):
        engine.submit(prompt, max_new_tokens=4)
    with pytest.raises(Overloaded) as info:
        engine.submit([5, 6, 9], max_new_tokens=4)  # one request must leave the queue first
    assert info.value.retry_after == pytest.approx(0.5, rel=0.05)
    engine.start()
    engine.stop(drain=True)
    hf_paged_kv.disable(model)


def test_retry_after_counts_only_the_requests_that_stay_ahead():
    """A refused request waits for the late requests that stay, not for late ones of shed
    priorities (the next tick turns them away at once), nor for itself; with nothing ahead, a
    retry may come at once (0.1 s)."""
    model = make_model("llama", seed=6)
    engine = Engine(model, pool=KVPool(num_blocks=32, block_size=8), slo=SLO(ttft=0.5, per_token=1.0))
    engine.accepting = True  # accept without running the loop: the queue is what the test puts in it
    controller = engine.load.controller
    controller.state, controller.shed_below = "overload", 1
    past = time.monotonic() - 2.0
    shed = [Request([4, 5, 6], SamplingParams(max_new_tokens=8), priority=0, arrived=past) for _ in range(3)]
    for request in shed:
        engine.scheduler.add(request)
    with pytest.raises(Overloaded) as info:
        engine.submit([5, 6, 7], max_new_tokens=2)  # refused behind late ones that are about to leave
    assert info.value.retry_after == 0.1  # no decision yet
    controller.last_tick = time.monotonic()  # a decision just now: the next one turns the late ones away
    with pytest.raises(Overloaded) as info:
        engine.submit([5, 6, 7], max_new_tokens=2)
    assert info.value.retry_after == pytest.approx(controller.limits.tick, abs=0.05)
    engine.scheduler.costs.record(100, 1.0)  # 100 tokens/s, and nothing admitted lately
    kept = Request([8, 9, 10, 11], SamplingParams(max_new_tokens=16), priority=1, arrived=past)
    engine.scheduler.add(kept)
    assert engine.load.retry_after(1, besides=shed[0]) == pytest.approx((4 + 16) / 100)  # the one ahead, not the queue
    engine.outcomes.turn_away(shed[0])
    assert shed[0].outcome == "rejected"
    with pytest.raises(Overloaded) as info:
        shed[0].stream.__iter__().__next__()
    assert info.value.retry_after == pytest.approx((4 + 16) / 100)
    controller.state, controller.shed_below = "normal", float("-inf")
    engine.start()
    engine.stop(drain=True)
    hf_paged_kv.disable(model)


def test_hit_rates_are_recent_and_the_service_figures_are_in_the_metrics():
    """The pool's hit counters are lifetime totals; the controller's signal is the share of
    the tokens looked up lately. Goodput, availability, the state and the shed level are in
    the metrics from the start, and so is every series of the counters with labels (at 0)."""
    model = make_model("llama", seed=4)
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8), slo=SLO(ttft=30.0, per_token=30.0))
    text = engine.prometheus()
    for line in ('hf_paged_kv_controller_state{state="overload"} 0.0', "hf_paged_kv_availability_ratio 1.0",
                 'hf_paged_kv_controller_setting{knob="shed_below_priority"} -Inf', "hf_paged_kv_goodput_requests_per_second",
                 'hf_paged_kv_controller_actions_total{knob="watermark"} 0.0',
                 'hf_paged_kv_controller_actions_total{knob="state"} 0.0',
                 'hf_paged_kv_requests_total{outcome="failed"} 0.0'):
        assert line in text
    prompt = list(range(3, 60))
    with engine:  # the engine samples its signals every step, and once more as it stops
        for _ in range(3):
            engine.submit(prompt, max_new_tokens=2).result(timeout=60)
    lifetime = engine.pool.stats()["hit_rate"]
    recent = engine.load.signals.read()["now"]["hit_rate_device"]
    assert lifetime < 0.7 < recent  # 2 of 3 lookups hit; the last one alone hit 48 of 56 tokens
    assert "hf_paged_kv_availability_ratio 1.0" in engine.prometheus()
    hf_paged_kv.disable(model)


def test_per_token_signal_is_each_finished_requests_mean_gap():
    """The batch-budget rule reads per-token latency as the target counts it: one value per
    finished request, its mean time between tokens (a single gap stretched by a prefill chunk
    is not a request over its target)."""
    model = make_model("llama", seed=3)
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8), limits=Limits(max_batch_tokens=32))
    with engine:
        handles = [engine.submit(list(range(3 + i, 40 + i)), max_new_tokens=6 + i) for i in range(3)]
        for handle in handles:
            handle.result(timeout=60)
        per_request = [(h.request.last_token - h.request.first_token) / (len(h.request.generated) - 1)
                       for h in handles]
        reading = engine.load.signals.read()["short"]
    assert engine.load.signals.p95("per_token", since=0.0)[1] == 3
    assert reading["per_token_mean"] == pytest.approx(sum(per_request) / 3)
    hf_paged_kv.disable(model)


def test_the_controller_gives_admission_its_targets_unless_they_are_set():
    model = make_model("llama", seed=1)
    pool = KVPool(num_blocks=16, block_size=8)
    controlled = Engine(model, pool=pool, slo=SLO(ttft=0.8, per_token=0.1))
    assert (controlled.limits.ttft_target, controlled.limits.per_token_target) == (0.8, 0.1)
    assert controlled.stats()["controller"]["ttft_target"] == 0.8
    assert controlled.stats()["controller"]["per_token_target"] == 0.1
    assert controlled.limits.burst_batch_tokens == 2 * controlled.limits.max_batch_tokens
    assert controlled.stats()["controller"]["burst_batch_tokens"] == 2 * controlled.limits.max_batch_tokens
    uncontrolled = Engine(model, pool=pool, controller=False, slo=SLO(ttft=0.8)).limits
    assert uncontrolled.ttft_target is None and uncontrolled.per_token_target is None
    assert uncontrolled.burst_batch_tokens is None
    given = Engine(model, pool=pool, slo=SLO(ttft=0.8),
                   limits=Limits(ttft_target=2.0, per_token_target=0.5, burst_batch_tokens=700))
    assert (given.limits.ttft_target, given.limits.per_token_target) == (2.0, 0.5)
    assert given.limits.burst_batch_tokens == 700
    shared = Limits()  # one Limits for two engines: the controlled one must not move the other's
    Engine(model, pool=pool, limits=shared, slo=SLO())
    assert shared.ttft_target is None and shared.per_token_target is None
    assert Engine(model, pool=pool, limits=shared, controller=False).limits.ttft_target is None
    hf_paged_kv.disable(model)


def test_every_engine_actuator_moves_under_pressure_and_comes_back():
    model = make_model("llama", seed=1)
    pool = KVPool(num_blocks=64, block_size=8, host_blocks=8, pin_budget=0.25, hot_threshold=8.0, half_life=600.0)
    engine = Engine(model, pool=pool, slo=SLO(), thresholds=Thresholds(dwell=0.0, tick=0.0))
    controller, signals = engine.load.controller, engine.load.signals
    before = controller.settings()
    now = into_pressure(controller, signals, time.monotonic())
    assert controller.state == "pressure"
    moved = {name for name, value in controller.settings().items() if value != before[name]}
    assert {"watermark", "growth_reserve", "pin_budget", "half_life", "hot_threshold", "demote_ahead"} <= moved
    assert pool.tuning()["half_life"] == 150.0 and pool.tuning()["pin_budget"] == 0.125
    now = calm_down(controller, signals, now)
    assert controller.state == "normal"
    assert {k: v for k, v in controller.settings().items() if k != "max_batch_tokens"} == {
        k: v for k, v in before.items() if k != "max_batch_tokens"}
    assert pool.tuning()["half_life"] == 600.0 and pool.tuning()["pin_budget"] == 0.25
    hf_paged_kv.disable(model)


def test_engine_under_a_burst_sheds_the_lowest_priority_and_recovers():
    """Tight targets and a burst of low-priority requests: the engine enters overload, refuses
    priority-0 requests with a retry_after while serving priority-5 ones, and returns to normal
    after the burst; every request either finished or was refused, and nothing leaked."""
    model = make_model("llama", seed=2)
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8),
                    limits=Limits(max_running=2, max_batch_tokens=64), slo=SLO(ttft=0.05, per_token=1.0),
                    thresholds=Thresholds(dwell=0.2, tick=0.05, overload_wait=2.0))
    prompt = lambda seed: torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(seed)).tolist()  # noqa
    handles, refused = [], []
    with engine:
        for i in range(40):
            try:
                handles.append(engine.submit(prompt(i), max_new_tokens=8, priority=5 if i % 4 == 0 else 0))
            except Overloaded as error:
                refused.append(error)
                assert error.retry_after >= 1.0
        states = set()
        for handle in handles:
            try:
                handle.result(timeout=120)
            except Overloaded as error:
                refused.append(error)
            states.add(engine.load.controller.state)
        assert "overload" in states or engine.stats()["controller"]["state"] != "normal" or refused
        deadline = time.monotonic() + 30
        while engine.load.controller.state != "normal" and time.monotonic() < deadline:
            time.sleep(0.1)  # idle: the short window forgets the burst
    stats = engine.stats()
    assert refused and stats["requests_rejected"] == len(refused)
    assert all(h.outcome in ("finished", "rejected") for h in handles)
    assert all(h.outcome == "finished" for h in handles if h.request.priority == 5)  # the high priority is served
    assert engine.load.controller.state == "normal" and engine.load.controller.shed_below == float("-inf")
    assert stats["requests_finished"] + stats["requests_rejected"] == 40
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)


def test_event_history_stays_within_the_long_window_when_nothing_reads_it():
    """An engine without a controller records events that nobody reads: recording forgets what
    has left the long window, so a long-running server keeps a bounded history."""
    signals = Signals(short=2.0, long=4.0, clock=lambda: 0.0)
    for second in range(1000):
        signals.record("arrival", now=float(second))
        signals.record("ttft", 0.1, now=float(second))
    assert all(len(signals.events[name]) <= 5 for name in ("arrival", "ttft"))
    assert signals.count("arrival", since=996.0) == 4


def test_rates_count_from_start_not_construction():
    clock = Clock()
    signals = Signals(short=10.0, long=60.0, clock=clock)
    clock.now = 100.0  # built long before it serves
    signals.start()
    clock.now = 102.0
    for _ in range(4):
        signals.record("arrival")
    reading = signals.read()
    assert reading["short"]["arrival_rate"] == pytest.approx(2.0)  # 4 in the 2 s since start, not 4 in 10 s
    assert reading["long"]["arrival_rate"] == pytest.approx(2.0)
    clock.now = 120.0
    assert signals.read()["short"]["arrival_rate"] == 0.0


def test_goodput_counts_from_the_engines_start_not_its_construction():
    model = make_model("llama", seed=4)
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8), slo=SLO(ttft=30.0, per_token=30.0))
    assert engine.stats()["goodput"] == 0.0  # not started: nothing served, no time passed serving
    time.sleep(1.0)  # built long before it serves
    with engine:
        started = time.monotonic()
        engine.submit(list(range(3, 20)), max_new_tokens=2).result(timeout=60)
        served = time.monotonic() - started
        goodput = engine.stats()["goodput"]
    assert engine.stats()["availability"] == 1.0
    assert goodput >= 1 / (served + 0.1) > 1 / 1.0  # one request over the time since start, not the 1 s before it
    hf_paged_kv.disable(model)


def test_an_engine_stopped_under_pressure_leaves_the_pool_as_configured():
    """The pin budget, hot threshold and half-life live on the pool, which generate and later
    engines use: an engine stopping mid-pressure puts them back, and the next engine starts from
    the configured values, not the tightened ones."""
    model = make_model("llama", seed=1)
    pool = KVPool(num_blocks=64, block_size=8, pin_budget=0.25, hot_threshold=8.0, half_life=600.0)
    engine = Engine(model, pool=pool, slo=SLO(), thresholds=Thresholds(dwell=0.0, tick=0.0))
    controller, signals = engine.load.controller, engine.load.signals
    into_pressure(controller, signals, time.monotonic())
    assert controller.state == "pressure" and pool.tuning()["half_life"] == 150.0 and pool.tuning()["pin_budget"] == 0.125
    engine.start()
    engine.stop()
    assert pool.tuning() == {"pin_budget": 0.25, "hot_threshold": 8.0, "half_life": 600.0}
    assert controller.state == "normal" and engine.stats()["controller"]["state"] == "normal"
    later = Engine(model, slo=SLO(), thresholds=Thresholds(dwell=0.0, tick=0.0)).load.controller.settings()
    assert later["half_life"] == 600.0 and later["pin_budget"] == 0.25 and later["hot_threshold"] == 8.0
    hf_paged_kv.disable(model)


def test_a_value_set_from_outside_becomes_the_configured_one():
    """An operator's change to an engine's knob while it runs is not overwritten: it becomes the
    knob's configured value, pressure only tightens from it, and normal returns to it."""
    model = make_model("llama", seed=1)
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8), slo=SLO(), thresholds=Thresholds(dwell=0.0, tick=0.0))
    controller, signals, limits = engine.load.controller, engine.load.signals, engine.limits
    now = time.monotonic() + 1.0
    signals.sample_levels(CALM, now)
    controller.tick(signals, now)
    limits.watermark, limits.max_batch_tokens = 0.2, 128
    now = into_pressure(controller, signals, now)
    assert controller.state == "pressure" and limits.watermark == 0.2  # tightened from the new value
    assert controller.knobs["max_batch_tokens"].configured == 128 and controller.knobs["max_batch_tokens"].high == 256
    calm_down(controller, signals, now)
    assert controller.state == "normal" and limits.watermark == 0.2 and limits.max_batch_tokens == 128
    hf_paged_kv.disable(model)


def test_the_burst_ceiling_the_controller_sets_follows_a_budget_set_from_outside():
    """Twice the budget's configured value: a user's new budget moves it (left at the old one, a
    budget set above it would leave no burst, and one set far below a ceiling many times over)."""
    model = make_model("llama", seed=1)
    ceilings = []
    for burst in (None, 700):
        engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8), slo=SLO(), thresholds=Thresholds(dwell=0.0, tick=0.0),
                        limits=Limits(max_batch_tokens=512, burst_batch_tokens=burst))
        ceilings.append(engine.limits.burst_batch_tokens)
        with engine:
            engine.limits.max_batch_tokens = 128
            deadline = time.monotonic() + 5.0
            while engine.limits.burst_batch_tokens == 1024 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # ticks enough for a ceiling the user set to have moved, were it moved
        ceilings.append(engine.stats()["controller"]["burst_batch_tokens"])
        hf_paged_kv.disable(model)
    assert ceilings == [1024, 256, 700, 700]  # the user's own stays


def test_two_engines_on_one_pool_do_not_tighten_each_others_pool_knobs():
    """The pool's knobs are configured by the KVPool's arguments: an engine whose controller
    reads another's tightened pin budget or half-life as configured would halve it again."""
    model = make_model("llama", seed=1)
    pool = KVPool(num_blocks=64, block_size=8, pin_budget=0.25, half_life=600.0)
    engines = [Engine(model, pool=pool, slo=SLO(), thresholds=Thresholds(dwell=0.0, tick=0.0)) for _ in range(2)]
    now = time.monotonic()
    for _ in range(3):
        for engine in engines:
            now = into_pressure(engine.load.controller, engine.load.signals, now)
    assert pool.tuning()["pin_budget"] == 0.125 and pool.tuning()["half_life"] == 150.0
    for engine in engines:
        engine.start()
        engine.stop()
    assert pool.tuning()["pin_budget"] == 0.25 and pool.tuning()["half_life"] == 600.0
    hf_paged_kv.disable(model)


def test_under_a_standing_queue_the_budget_comes_back_from_a_shrink_and_from_growth():
    """A queue that never empties must not hold the budget at its floor once per-token latency
    has headroom again, nor above the configured value once first tokens use most of their target."""
    clock, signals, controller, applied, _ = setup()
    budget = controller.knobs["max_batch_tokens"]
    run(clock, signals, controller, CALM | dict(queue_depth=4), 4, events=[("per_token", 0.5)])
    assert budget.value < 256  # slow tokens: shrunk
    run(clock, signals, controller, CALM | dict(queue_depth=4, oldest_wait=0.6), 30, events=[("per_token", 0.02)])
    assert budget.value == 256  # headroom between tokens, first tokens at 0.6 of their target: back, no further
    run(clock, signals, controller, CALM | dict(queue_depth=4), 10, events=[("per_token", 0.02)])
    assert budget.value > 256  # both have headroom: it grows past the configured budget
    run(clock, signals, controller, CALM | dict(queue_depth=4, oldest_wait=0.95), 30, events=[("per_token", 0.02)])
    assert budget.value == 256  # first tokens at 95 % of their target: back down to the configured budget


def test_a_budget_of_two_tokens_can_grow():
    clock, signals = Clock(), Signals(short=2.0, long=4.0, clock=Clock())
    knob = Knob("max_batch_tokens", 2, {}, 2, 4, lambda value: None)
    controller = Controller([knob], SLO(ttft=1.0, per_token=0.1), Thresholds(dwell=3.0, tick=0.5))
    run(clock, signals, controller, CALM | dict(queue_depth=4), 3, events=[("per_token", 0.01)])
    assert knob.value > 2


def test_a_preempted_request_waiting_is_not_a_level_to_shed_through():
    """Its effective priority counts its preemptions, and it has its first token, so it can never
    be shed: taken as the highest waiting level, it let the highest client priority be shed."""
    model = make_model("llama", seed=1)
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8), slo=SLO(ttft=0.05),
                    thresholds=Thresholds(dwell=0.2, tick=0.0, overload_wait=2.0))
    engine.accepting = True  # accept without running the loop: the test drives the ticks
    engine.load.start()
    past = time.monotonic() - 5.0
    waiting = [Request([3, 4, 5], SamplingParams(4), priority=p, arrived=past) for p in (0, 0, 5, 5)]
    resumed = Request([3, 4, 5], SamplingParams(4), priority=5, arrived=past)
    resumed.preemptions, resumed.generated, resumed.first_token, resumed.last_token = 1, [7], past + 0.1, past + 0.1
    for request in [*waiting, resumed]:
        engine.scheduler.add(request)
    for _ in range(12):
        for request in engine.load.tick():  # what the engine's loop does with those it names
            engine.outcomes.turn_away(request)
        time.sleep(0.05)
    assert engine.load.controller.state == "overload" and engine.load.controller.shed_below == 1
    assert [r.outcome for r in waiting] == ["rejected", "rejected", None, None]
    engine.submit([3, 4, 5], priority=5)  # the highest client priority is not shed
    engine.start()
    engine.stop(drain=False)
    hf_paged_kv.disable(model)


def test_demotion_ahead_of_need_runs_without_the_controller():
    model = make_model("llama", seed=1)
    pool = KVPool(num_blocks=32, block_size=8, host_blocks=32)
    engine = Engine(model, pool=pool, limits=Limits(demote_ahead=0.9), controller=False)
    with engine:
        for seed in range(4):
            engine.submit(torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(seed)).tolist(),
                          max_new_tokens=2).result(timeout=60)
        deadline = time.monotonic() + 10
        while pool.stats()["blocks_free"] < 0.9 * 32 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert pool.stats()["blocks_free"] >= int(0.9 * 32) and pool.stats()["host_blocks_used"] > 0
    hf_paged_kv.disable(model)


def test_retry_after_counts_requests_the_loop_has_not_taken_in_yet():
    """While the loop is inside a forward, the backlog is still in the engine's incoming queue:
    a refusal then must not say 0.1 s."""
    model = make_model("llama", seed=1)
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8), limits=Limits(max_waiting=4))
    engine.accepting = True  # as if the loop were busy in a forward: nothing is taken in
    engine.load.start()
    for _ in range(8):
        engine.scheduler.costs.record(100, 1.0)  # 100 tokens/s
    for _ in range(4):
        engine.submit([5] * 200, max_new_tokens=200)
    with pytest.raises(Overloaded) as info:
        engine.submit([3, 4, 5])
    assert info.value.retry_after == pytest.approx(400 / 100, rel=0.05)  # the first one ahead: 400 tokens
    engine.start()
    engine.stop(drain=False)
    hf_paged_kv.disable(model)


@pytest.mark.parametrize("wrong", [dict(short_window=0), dict(long_window=-1), dict(kv_low=0.95),
                                   dict(recover_wait=7.0), dict(dwell=-1), dict(short_window=120)])
def test_thresholds_are_checked(wrong):
    with pytest.raises(ValueError, match="invalid Thresholds"):
        Thresholds(**wrong)
