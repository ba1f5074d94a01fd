"""A forward carrying decodes holds no more prefill than they can afford against their per-token
target: the budget follows the decodes' slack on the fitted cost line, prompts still advance,
and an engine that paces still gives `generate`'s tokens."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import assert_pool_clean, make_model
from test_engine import NEW, alone, prompts

from hf_paged_kv import Engine, KVPool
from hf_paged_kv.engine import Limits
from hf_paged_kv.engine.costs import MOST_TOKENS, StepCosts
from hf_paged_kv.engine.pacing import MARGIN, MIN_PREFILL, slack, step_budget
from hf_paged_kv.engine.request import Request, SamplingParams
from hf_paged_kv.cache.sequence import Sequence

TARGET = 0.3
LIMITS = Limits(max_batch_tokens=512, per_token_target=TARGET)


def decoding(tokens: int, since: float, prompt: int = 8, now: float | None = None) -> Request:
    """A running request that has generated `tokens`, its first `since` seconds before `now`,
    its prompt's and generated tokens' KV stored but the last token's."""
    request = Request(list(range(3, 3 + prompt)), SamplingParams(max_new_tokens=64))
    request.generated = list(range(500, 500 + tokens))
    request.computed = prompt + tokens - 1  # its last token is the next one fed: a decode
    request.sequence = Sequence(length=request.computed, tokens=request.tokens()[: request.computed],
                                history=bytearray(b"\x01" * request.computed))
    request.first_token = (time.monotonic() if now is None else now) - since
    return request


def test_slack_is_the_pause_that_still_meets_the_per_token_target_with_one_more_token():
    now = time.monotonic()
    # 5 tokens at a 0.5 s target: the 6th may come 2.5 s after the first; 1 s passed
    assert slack(decoding(5, since=1.0, now=now), 0.5, now) == pytest.approx(1.5)
    assert slack(decoding(5, since=3.0, now=now), 0.5, now) < 0  # already behind its target's pace


def queued(prompt: int, arrived: float) -> Request:
    return Request(list(range(3, 3 + prompt)), SamplingParams(max_new_tokens=8), arrived=arrived)


QUEUED = [queued(40, time.monotonic())]  # a prompt waiting; without a TTFT target only whether something waits matters


def costs_of(fixed: float, per_token: float) -> StepCosts:
    costs = StepCosts()
    for tokens in (4, 40, 120, 250, 8, 60):
        costs.record(tokens, fixed + per_token * tokens)
    return costs


def started(tokens: int, since: float, last: float, now: float):
    """A decode with `tokens` generated, the first `since` and the last `last` seconds before `now`."""
    request = decoding(tokens, since=since, now=now)
    request.last_token = now - last
    return request


def test_tokens_within_reads_the_fitted_line():
    costs = costs_of(0.05, 0.001)
    assert costs.tokens_within(0.25) == pytest.approx(200, abs=1)
    assert costs.tokens_within(0.04) < 0  # the fixed cost alone takes longer
    assert StepCosts().tokens_within(1.0) is None  # no steps, no line
    alike = StepCosts()
    alike.record(10, 0.1)
    alike.record(12, 0.1)
    assert alike.tokens_within(1.0) == pytest.approx(1.0 / (0.2 / 22), abs=1)  # no slope: the mean cost per token


def test_the_allowance_is_the_time_to_the_targets_pace_or_one_target_since_the_last_token():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    fresh = started(1, since=0.0, last=0.0, now=now)  # its second token is due within one target
    assert step_budget([fresh], QUEUED, LIMITS, costs, now) == costs.tokens_within(MARGIN * TARGET)
    paced = started(3, since=0.5, last=0.1, now=now)  # 3 tokens: the 4th due 0.9 s after the first, 0.4 s from now
    assert step_budget([paced], QUEUED, LIMITS, costs, now) == pytest.approx(290, abs=1)  # n - 1: 120, n + 1: 512
    behind = started(5, since=3.0, last=0.1, now=now)  # behind its pace: one target since its last token
    assert step_budget([behind], QUEUED, LIMITS, costs, now) == pytest.approx(costs.tokens_within(MARGIN * 0.2), abs=1)


def test_requests_ahead_of_their_target_cap_nothing_and_the_tightest_sets_the_budget():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    ahead = started(40, since=2.0, last=0.05, now=now)  # 40 tokens in 2 s: 10 s of its target's pace left
    assert step_budget([ahead], QUEUED, LIMITS, costs, now) == 512
    fresh = started(1, since=0.0, last=0.0, now=now)
    assert step_budget([ahead, fresh], QUEUED, LIMITS, costs, now) == costs.tokens_within(MARGIN * TARGET)


def test_only_decoding_requests_cap_the_budget():
    """A request still feeding its prompt has no pace to keep; one recomputing its KV after a
    preemption gets its next token only after the whole recompute, which a capped forward would
    only spread over more forwards (500 tokens: 32 forwards, 2.1 s instead of 0.56 s)."""
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    prefilling = decoding(0, since=0.0, now=now)
    prefilling.first_token, prefilling.computed = None, 4  # still feeding its prompt
    assert step_budget([prefilling], QUEUED, LIMITS, costs, now) == 512
    resumed = started(1, since=0.0, last=0.0, now=now)
    resumed.computed = 2  # recomputing its KV after a preemption
    assert step_budget([resumed], QUEUED, LIMITS, costs, now) == 512
    fresh = started(1, since=0.0, last=0.0, now=now)  # a decode beside it still sets the pace
    assert step_budget([resumed, fresh], QUEUED, LIMITS, costs, now) == costs.tokens_within(MARGIN * TARGET)


def test_unpaced_without_a_target_a_cost_line_or_a_prompt_that_could_join():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    fresh = started(1, since=0.0, last=0.0, now=now)
    assert step_budget([fresh], QUEUED, Limits(max_batch_tokens=512), costs, now) == 512
    assert step_budget([fresh], QUEUED, LIMITS, StepCosts(), now) == 512
    assert step_budget([fresh], [], LIMITS, costs, now) == 512  # nothing waits, everything decodes


def test_prompts_still_advance_when_the_decodes_use_up_the_allowance():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    decodes = [started(1, since=0.0, last=0.0, now=now) for _ in range(8)]
    assert step_budget(decodes, QUEUED, Limits(max_batch_tokens=512, per_token_target=0.01), costs, now) == 8 + MIN_PREFILL


@pytest.mark.parametrize("per_token_target", [None, 1e-6])
def test_an_engine_paces_a_prompt_beside_a_decode_it_cannot_afford(per_token_target, monkeypatch):
    """With a per-token target no forward can meet, a long prompt arriving while another request
    decodes advances `MIN_PREFILL` tokens a forward beside it (without a target, all at once),
    and its tokens are still `generate`'s."""
    model = make_model("llama", seed=3)
    first, second = prompts([20, 200], seed=5)
    expected = alone(model, second)
    engine = Engine(model, pool=KVPool(num_blocks=96, block_size=8),
                    limits=Limits(max_batch_tokens=512, per_token_target=per_token_target), controller=False)
    for tokens in (1, 200) * 16:  # a steep cost line, kept: the engine's own steps do not move it
        engine.scheduler.costs.record(tokens, 0.01 * tokens)
    monkeypatch.setattr(engine.scheduler.costs, "record", lambda tokens, seconds: None)
    sizes = []  # tokens fed to each forward
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: sizes.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        with engine:
            decoder = engine.submit(first, max_new_tokens=120, eos_token_id=[])
            next(iter(decoder.stream()))
            late = engine.submit(second, max_new_tokens=NEW)
            assert late.result(timeout=120) == expected
            decoder.result(timeout=120)
    finally:
        hook.remove()
    if per_token_target is None:
        assert max(sizes) >= 200
    else:  # after the first prompt's own forward, none holds more than the decode and MIN_PREFILL
        assert max(sizes[1:]) <= 1 + MIN_PREFILL
        assert late.timings["first_token"] < decoder.timings["finished"]  # it did not wait for the decode to end
    assert_pool_clean(engine.pool)


@pytest.mark.parametrize("ttft, waited, prompt, whole", [
    (0.38, 0.0, 300, True),  # one forward of 301 tokens (0.351 s) in time, two (0.402 s) not: not split
    (1.0, 0.0, 300, False),  # in time even split: paced
    (0.38, 0.2, 300, False),  # late even whole: paced
    (0.38, 0.0, 100, False),  # fits the paced budget anyway
    (0.7, 0.0, 600, False),  # more than max_batch_tokens: paced
])
def test_pacing_does_not_split_a_prompt_that_only_one_forward_gets_in_time(ttft, waited, prompt, whole):
    now, costs = time.monotonic(), costs_of(0.05, 0.001)  # a forward's fixed cost: 50 tokens' worth
    limits = Limits(max_batch_tokens=512, per_token_target=TARGET, ttft_target=ttft)
    fresh = started(1, since=0.0, last=0.0, now=now)
    paced = costs.tokens_within(MARGIN * TARGET)
    budget = step_budget([fresh], [queued(prompt, now - waited)], limits, costs, now)
    assert budget == (1 + prompt if whole else paced)


def test_the_next_prompt_in_line_is_a_running_prefill_before_the_queue():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    limits = Limits(max_batch_tokens=512, per_token_target=TARGET, ttft_target=0.38)
    fresh = started(1, since=0.0, last=0.0, now=now)
    prefilling = queued(300, now)
    prefilling.computed = 20  # its first chunk fed: 280 tokens left
    assert step_budget([fresh, prefilling], [queued(290, now)], limits, costs, now) == 1 + 280


def test_a_preempted_request_waiting_is_work_ahead_of_the_prompts_and_no_prompt_itself():
    """Admission feeds a preempted request's recompute before the prompts behind it: the forward
    grows only where the prompt still gets its first token in time behind it."""
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    limits = Limits(max_batch_tokens=512, per_token_target=TARGET, ttft_target=0.38)
    fresh = started(1, since=0.0, last=0.0, now=now)
    paced = costs.tokens_within(MARGIN * TARGET)

    def preempted(tokens: int) -> Request:
        request = queued(tokens, now)
        request.first_token = now - 1.0
        return request

    assert step_budget([fresh], [preempted(100), queued(150, now)], limits, costs, now) == 1 + 100 + 150
    # 300 + 280 tokens: one forward of both ends past the prompt's target, so the line stops
    assert step_budget([fresh], [preempted(300), queued(280, now)], limits, costs, now) == paced
    assert step_budget([fresh], [preempted(300)], limits, costs, now) == paced


BURST = Limits(max_batch_tokens=256, burst_batch_tokens=512, ttft_target=0.45)  # one forward of 400 tokens: in time


def test_prompts_arriving_together_get_one_forward_past_the_budget_when_a_split_would_make_one_late():
    """150 + 150 tokens: 256 then 44 (+ a fixed cost) ends 0.40 s after they came, past 85 % of
    the 0.45 s target; one forward of 300 ends at 0.35 s. Without a ceiling above the budget, or
    without a TTFT target, the budget stays."""
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    pair = [queued(150, now), queued(150, now)]
    assert step_budget([], pair, BURST, costs, now) == 300
    assert step_budget([], pair, Limits(max_batch_tokens=256, ttft_target=0.45), costs, now) == 256
    assert step_budget([], pair, Limits(max_batch_tokens=256, burst_batch_tokens=512), costs, now) == 256
    assert step_budget([], [queued(100, now), queued(100, now)], BURST, costs, now) == 256  # fits anyway


def test_the_forward_grows_to_the_last_prompt_a_split_would_make_late_and_never_past_the_target():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    assert step_budget([], [queued(150, now), queued(150, now), queued(20, now)], BURST, costs, now) == 320
    # a fourth prompt would take one forward past the target for all of them: it is left out
    assert step_budget([], [queued(150, now), queued(150, now), queued(200, now)], BURST, costs, now) == 300
    # a prompt already too late for one forward stops the line: those behind it are not weighed
    assert step_budget([], [queued(150, now - 0.3), queued(150, now)], BURST, costs, now) == 256


def test_a_prompt_is_weighed_by_its_own_split_not_by_the_tightest_prompt_before_it():
    """A (40 tokens, 0.15 s waited) is whole in the first forward either way; B (200 tokens)
    split 128 + 72 gets its first token at 0.35 s, within 85 % of its 0.45 s target: no growth,
    which would end A's forward at 0.44 s after its arrival."""
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    limits = Limits(max_batch_tokens=128, burst_batch_tokens=512, ttft_target=0.45)
    assert step_budget([], [queued(40, now - 0.15), queued(200, now)], limits, costs, now) == 128


def test_a_target_of_any_finite_size_sizes_a_forward_without_overflowing():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    assert costs.tokens_within(1e306) == MOST_TOKENS
    limits = Limits(max_batch_tokens=256, burst_batch_tokens=512, ttft_target=1e300, per_token_target=1e300)
    fresh = started(1, since=0.0, last=0.0, now=now)
    assert step_budget([fresh], [queued(150, now), queued(150, now)], limits, costs, now) == 256


def test_a_waiting_prompt_counts_only_the_tokens_it_would_compute():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    cached, fresh = queued(400, now), queued(150, now)
    assert step_budget([], [fresh, cached], BURST, costs, now) == 256  # 550 tokens: never in time
    uncached = {id(cached): 150, id(fresh): 150}
    assert step_budget([], [fresh, cached], BURST, costs, now, uncached=lambda r: uncached[id(r)]) == 300


def test_a_burst_past_the_budget_leaves_the_decodes_their_pace_where_the_prompts_are_in_time_anyway():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    limits = Limits(max_batch_tokens=256, burst_batch_tokens=512, ttft_target=2.0, per_token_target=TARGET)
    fresh = started(1, since=0.0, last=0.0, now=now)
    assert step_budget([fresh], [queued(150, now), queued(150, now)], limits, costs, now) == \
        costs.tokens_within(MARGIN * TARGET)


@pytest.mark.parametrize("burst", [None, 256])
def test_an_engine_feeds_two_prompts_in_one_forward_past_its_budget_when_only_that_is_in_time(burst, monkeypatch):
    """Two 60-token prompts queued together (behind a 5-token opener whose forward waits for
    them), a 64-token budget, a line of 10 ms a token and a
    1.3 s target: one forward of 120 tokens (1.2 s) gives both their first token in time, a split
    (64, then 56) the second at about 1.2 s plus a forward's overhead, past 85 % of the target.
    With `burst_batch_tokens` the engine runs the one forward; without it, no forward passes the
    budget. Either way the tokens are `generate`'s."""
    model = make_model("llama", seed=3)
    pair = prompts([60, 60], seed=7)
    expected = [alone(model, p) for p in pair]
    limits = Limits(max_batch_tokens=64, ttft_target=1.3, burst_batch_tokens=burst)
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8), limits=limits, controller=False)
    for tokens in (1, 200) * 16:  # a steep cost line through the origin, kept
        engine.scheduler.costs.record(tokens, 0.01 * tokens)
    monkeypatch.setattr(engine.scheduler.costs, "record", lambda tokens, seconds: None)
    sizes, release = [], threading.Event()

    def forward(_, args, kwargs):
        sizes.append(kwargs["input_ids"].shape[1])
        release.wait(timeout=60)  # the first forward (the opener's, or all three) waits until both are queued

    hook = model.register_forward_pre_hook(forward, with_kwargs=True)
    try:
        with engine:
            opener = engine.submit(prompts([5], seed=9)[0], max_new_tokens=1)
            handles = [engine.submit(p, max_new_tokens=NEW) for p in pair]
            release.set()
            opener.result(timeout=120)
            assert [h.result(timeout=120) for h in handles] == expected
    finally:
        hook.remove()
    assert max(sizes) >= 120 if burst else max(sizes) <= 64  # both prompts whole in one forward, or none past 64
    assert_pool_clean(engine.pool)
