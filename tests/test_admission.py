"""The engine's admission order: a burst's short prompts first, a long prompt keeps its turn
against later arrivals, and memory lets a request's equals pass it only for a while."""

from __future__ import annotations

import time

import pytest
import torch

from hf_paged_kv import KVPool
from hf_paged_kv.engine import runner
from hf_paged_kv.engine.admission import LATE_YIELD, Admission
from hf_paged_kv.engine.costs import StepCosts
from hf_paged_kv.engine.metrics import EngineMetrics
from hf_paged_kv.engine.request import Request, SamplingParams
from hf_paged_kv.engine import Limits
from hf_paged_kv.engine.scheduler import Scheduler
from hf_paged_kv.pool import LayerSpec
from hf_paged_kv.reuse.prefix_index import PUBLIC_TENANT
from hf_paged_kv.sequence import Sequence

MODEL = "test-model"  # the weights' fingerprint, as the engine passes it


def admission(num_blocks=256, block_size=4, backfill_wait=1.0, seconds_per_token=0.001, ttft_target=None):
    pool = KVPool(num_blocks=num_blocks, block_size=block_size)
    pool.bind([LayerSpec(2, 8, torch.device("cpu"))], torch.float32)
    scheduler = Scheduler(pool, Limits(backfill_wait=backfill_wait, ttft_target=ttft_target))
    admit = Admission(pool, scheduler)
    admit.costs.record(1, seconds_per_token)  # the recent cost of a token, no fixed cost per step
    admit.costs.record(100, 100 * seconds_per_token)
    return admit


def queue(admit: Admission, length: int, arrived: float, priority: int = 0, first: int = 3) -> Request:
    request = Request(list(range(first, first + length)), SamplingParams(max_new_tokens=4), priority=priority)
    request.arrived = arrived
    admit.scheduler.enqueue(request)
    return request


def cache_prefix(admit: Admission, owner: str = "default") -> list[int]:
    """80 tokens in 20 cached blocks of `owner`, as an earlier request leaves them."""
    cached = list(range(3, 83))
    blocks = admit.pool.allocate(20)
    admit.pool.reuse.index_sequence(MODEL, owner, Sequence(blocks=blocks, length=80, tokens=cached,
                                                           history=bytearray(b"\x01" * 80)), 0)
    admit.pool.decref(blocks)
    return cached


def admitted(admit: Admission, budget: int = 10_000, ends_prompts: bool = False) -> list[Request]:
    chosen = admit.admit(budget, MODEL, EngineMetrics(), ends_prompts)
    return [request for request, _ in chosen]


def test_a_burst_is_admitted_shortest_prompt_first():
    admit, now = admission(), time.monotonic()
    long, short, middle = (queue(admit, n, now, first=100 * i) for i, n in enumerate((120, 10, 50)))
    assert admitted(admit) == [short, middle, long]


def test_a_long_prompt_keeps_its_turn_against_requests_arriving_after_its_compute_time():
    admit, now = admission(seconds_per_token=0.001), time.monotonic()
    long = queue(admit, 120, now - 0.5)  # 0.12 s of compute, arrived 0.5 s before the short one
    short = queue(admit, 10, now, first=500)
    assert admitted(admit) == [long, short]


def test_without_a_target_the_oldest_of_a_late_queue_goes_first():
    admit, now = admission(seconds_per_token=0.001), time.monotonic()
    late = queue(admit, 10, now - 1.0)  # waited 1 s
    fresh = queue(admit, 120, now, first=500)
    assert admitted(admit) == [late, fresh]


def test_a_request_past_its_ttft_target_yields_to_one_that_can_still_meet_it():
    admit, now = admission(seconds_per_token=0.001, ttft_target=0.5), time.monotonic()
    late = queue(admit, 10, now - 1.0)  # waited 1 s: its first token comes after the 0.5 s target whatever happens
    fresh = queue(admit, 120, now, first=500)  # 0.12 s of compute: it can still make it
    assert admitted(admit) == [fresh, late]


def test_a_request_whose_compute_would_take_it_past_the_target_yields_too():
    admit, now = admission(seconds_per_token=0.001, ttft_target=0.5), time.monotonic()
    doomed = queue(admit, 200, now - 0.4)  # waited 0.4 s, needs 0.2 s more: late
    short = queue(admit, 10, now - 0.1, first=500)
    long_ = queue(admit, 300, now, first=900)  # 0.3 s: still in time
    assert admitted(admit) == [short, long_, doomed]


def test_a_late_request_yields_for_a_bounded_time():
    admit, now = admission(seconds_per_token=0.001, ttft_target=0.5), time.monotonic()
    late = queue(admit, 10, now - 1.0 - LATE_YIELD * 0.5)  # late for longer than it yields
    fresh = queue(admit, 10, now, first=500)
    assert admitted(admit) == [late, fresh]


def test_a_preempted_request_never_yields_and_priority_still_comes_first():
    admit, now = admission(seconds_per_token=0.001, ttft_target=0.5), time.monotonic()
    resumed = queue(admit, 10, now - 1.0)
    resumed.generated = [7]  # it has had its first token: the target is behind it
    late_high = queue(admit, 10, now - 1.0, priority=1, first=300)
    fresh = queue(admit, 10, now, first=500)
    assert admitted(admit) == [late_high, resumed, fresh]


def test_with_a_target_a_partial_chunk_waits_for_a_forward_without_first_tokens():
    """A forward that already ends prompts takes no partial chunk of another when the chunk
    would delay their first tokens by more than a tenth of the target, and nothing behind it in
    the order is admitted (not even a request of its priority that fits, as memory would let
    pass). A cheap chunk is not deferred, and without a target the budget is filled."""
    def burst(ttft_target):
        admit, now = admission(seconds_per_token=0.001, ttft_target=ttft_target), time.monotonic()
        short, middle, long_ = (queue(admit, n, now, first=100 * i) for i, n in enumerate((10, 20, 60)))
        later = queue(admit, 5, now + 0.2, first=400)  # after long_ in the order, fits what is left
        return admit, short, middle, long_, later
    admit, short, middle, long_, later = burst(ttft_target=0.1)  # 20 tokens x 1 ms > 0.01 s
    assert admitted(admit, budget=50) == [short, middle]
    assert admitted(admit, budget=50) == [long_]  # a forward without first tokens: it starts
    admit, short, middle, long_, later = burst(ttft_target=0.05)  # 8 tokens x 1 ms > 0.005 s
    assert admitted(admit, budget=8, ends_prompts=True) == []  # the running part ends a prompt already
    assert admitted(admit, budget=8) == [short]  # a forward of decodes only: it starts
    admit, short, middle, long_, later = burst(ttft_target=5.0)  # a 0.02 s delay against 5 s: not worth a forward
    assert admitted(admit, budget=50) == [short, middle, long_]
    admit, short, middle, long_, later = burst(ttft_target=None)
    assert admitted(admit, budget=50) == [short, middle, long_]


def test_a_deferral_counts_cached_prefixes_and_leaves_the_pool_untouched():
    """Whether a prompt's chunk is partial is judged on what it would inherit; deferring it
    references, touches and counts nothing. A resumed request is never deferred."""
    admit, now = admission(seconds_per_token=0.001, ttft_target=0.05), time.monotonic()
    cached = cache_prefix(admit, "default")
    follow_up = Request(cached + [7] * 8, SamplingParams(max_new_tokens=4))  # 8 tokens to compute
    follow_up.arrived = now
    admit.scheduler.enqueue(follow_up)
    assert admitted(admit, budget=10, ends_prompts=True) == [follow_up] and follow_up.inherited == 80
    long_ = queue(admit, 40, now, first=900)  # nothing cached: 40 tokens
    before = admit.pool.stats()
    assert admitted(admit, budget=10, ends_prompts=True) == []
    assert admit.pool.stats() == before and long_.sequence.blocks == [] and long_.computed == 0
    long_.generated = [5]  # as if preempted after its first token: resuming is never deferred
    assert admitted(admit, budget=10, ends_prompts=True) == [long_]


def test_a_chunk_ends_a_prompt_only_before_the_first_token():
    request = Request(list(range(3, 13)), SamplingParams(max_new_tokens=4))
    assert request.ends_prompt(10) and not request.ends_prompt(9)
    request.computed, request.generated = 10, [7]  # resumed or decoding: its first token is out
    assert request.remaining == 1 and not request.ends_prompt(1)


def test_the_marginal_cost_of_a_token_leaves_out_a_steps_fixed_cost():
    costs = StepCosts()
    costs.record(4, 0.2)
    assert costs.marginal_seconds_per_token() == 0.0  # no spread of step sizes yet: no evidence
    costs.recent.clear()
    for tokens in (1, 41, 256, 1, 5):  # 0.1 s per step, 3 ms per token
        costs.record(tokens, 0.1 + 0.003 * tokens)
    assert costs.marginal_seconds_per_token() == pytest.approx(0.003)
    assert costs.seconds_per_token() > 0.003  # the mean counts the fixed costs too
    for _ in range(40):  # a quiet spell of alike decode steps: the last slope stands
        costs.record(3, 0.15)
    assert costs.marginal_seconds_per_token() == pytest.approx(0.003)
    costs.recent.clear()
    for tokens in (1, 64, 128, 2):  # time falling with tokens (noise): never negative
        costs.record(tokens, 0.3 - 0.001 * tokens)
    assert costs.marginal_seconds_per_token() == 0.0


@pytest.mark.parametrize("owner", ["default", PUBLIC_TENANT])  # the request's tenant, or published to all
def test_cached_tokens_do_not_count_as_work(owner):
    admit, now = admission(), time.monotonic()
    cached = cache_prefix(admit, owner)
    fresh = queue(admit, 40, now, first=900)
    follow_up = Request(cached + [7] * 8, SamplingParams(max_new_tokens=4))  # 88 tokens, 8 of them to compute
    follow_up.arrived = now
    admit.scheduler.enqueue(follow_up)
    assert admitted(admit) == [follow_up, fresh]
    assert follow_up.inherited == 80


def test_a_prompt_cached_whole_still_computes_the_block_of_its_last_token():
    """Inheriting stops before the block holding the last token (its logits are needed): a
    prompt that is exactly a cached prefix computes that block, and `uncached` says so."""
    admit, now = admission(), time.monotonic()
    cached = cache_prefix(admit)
    admitted(admit)  # takes the weights' fingerprint, as the engine's first admitting step does
    whole = queue(admit, 80, now)  # the 80 cached tokens, 20 blocks of 4
    longer = Request(cached + [7] * 8, SamplingParams(max_new_tokens=4), arrived=now)
    assert (admit.uncached(whole), admit.uncached(longer)) == (4, 8)
    assert admitted(admit) == [whole] and whole.inherited == 76


def hold(admit: Admission, blocks: int) -> None:
    """Occupy `blocks` of the pool, as running sequences would."""
    admit.pool.allocate(blocks)


def test_memory_lets_requests_of_the_same_priority_pass_a_blocked_one_while_it_is_young():
    admit, now = admission(num_blocks=16, backfill_wait=1.0), time.monotonic()
    hold(admit, 10)
    big = queue(admit, 30, now - 0.2)  # 8 blocks: does not fit beside the 10 held
    small = queue(admit, 6, now, first=500)  # 2 blocks: fits
    assert admitted(admit) == [small]
    assert admit.scheduler.waiting == [big]


def test_a_request_blocked_longer_than_backfill_wait_is_passed_by_no_one():
    admit, now = admission(num_blocks=16, backfill_wait=1.0), time.monotonic()
    hold(admit, 10)
    big = queue(admit, 30, now - 1.5)
    small = queue(admit, 6, now, first=500)
    assert admitted(admit) == []
    assert admit.scheduler.waiting == [big, small]


def test_a_lower_priority_never_passes_a_blocked_request():
    admit, now = admission(num_blocks=16, backfill_wait=1.0), time.monotonic()
    hold(admit, 10)
    big = queue(admit, 30, now - 0.2, priority=1)
    small = queue(admit, 6, now, priority=0, first=500)
    assert admitted(admit) == []
    assert admit.scheduler.waiting == [big, small]


@pytest.mark.parametrize("num_blocks, limits, reserved", [
    (64, Limits(), 1 + int(0.7 * (64 * 4 // 8) / 4)),  # an eighth of the pool: 32 tokens counted
    (4096, Limits(growth_clip=40), 1 + int(0.7 * 40 / 4)),  # the clip: 40 tokens counted
    (16384, Limits(), 1 + int(0.7 * 4000 / 4)),  # below both: what it may still generate
    (64, Limits(growth_clip=None), 1 + int(0.7 * 4000 / 4)),  # no clip
])
def test_the_growth_reserve_counts_a_bounded_share_of_max_new_tokens(num_blocks, limits, reserved):
    """A request asking for the rest of a long context (a server's default) reserves at most
    `Limits.growth_clip` tokens and an eighth of the pool: many such requests still run together."""
    pool = KVPool(num_blocks=num_blocks, block_size=4)
    pool.bind([LayerSpec(2, 8, torch.device("cpu"))], torch.float32)
    scheduler = Scheduler(pool, limits)
    request = Request([3] * 8, SamplingParams(max_new_tokens=4000))
    request.computed = 8  # its prompt is in: only what it may generate is reserved
    scheduler.running.append(request)
    assert scheduler.reserve() == reserved


def test_the_growth_clip_must_be_a_positive_number_of_tokens():
    with pytest.raises(ValueError, match="growth_clip must be >= 1"):
        Limits(growth_clip=0)


def preempted_midway(admit: Admission, request: Request, computed: int) -> None:
    """Admit `request`, store its first `computed` tokens as a forward would, then preempt it."""
    assert admitted(admit, budget=computed) == [request]
    runner.commit([(request, computed)])
    admit.preemption.preempt(request)


def test_a_prefill_preempted_midway_counts_the_tokens_it_inherits_beyond_what_it_computed():
    """It stored 16 of its 100 tokens; another computed the first 80 meanwhile: coming back, it
    inherits 64 prompt tokens no forward of its own computed, and they are counted."""
    admit, metrics = admission(), EngineMetrics()
    request = queue(admit, 100, time.monotonic())
    preempted_midway(admit, request, 16)
    cache_prefix(admit)
    assert [r for r, _ in admit.admit(10_000, MODEL, metrics, False)] == [request]
    assert request.inherited == 80 and metrics.counters["tokens_inherited"] == 64
    assert runner.token_kinds([(request, 20)]) == (20, 0)  # the rest of its prompt: computed for the first time


def test_a_swapped_partial_block_is_not_restored_under_other_weights():
    """A request preempted with its prompt's 3 tokens in a partial block keeps their K/V on the
    host; if the weights change while it waits, they are stale: it computes them again."""
    for model, restored in ((MODEL, 3), ("other-weights", 0)):
        admit = admission()
        admit.costs.record(1, 0.5)  # recomputing looks expensive: the partial block is swapped
        request = queue(admit, 3, time.monotonic())
        assert admitted(admit) == [request]
        runner.commit([(request, 3)])
        request.generated.append(7)  # its first token, sampled from that forward
        admit.preemption.preempt(request)
        assert request.swapped is not None
        assert [r for r, _ in admit.admit(10_000, model, EngineMetrics(), False)] == [request]
        assert request.computed == request.sequence.length == restored and request.swapped is None
