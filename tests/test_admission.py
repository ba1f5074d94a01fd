"""The scheduler's admission: a burst's short prompts first, a long prompt keeps its turn
against later arrivals, memory lets a request's equals pass it only for a while, and preempted
requests come back with the KV they had. Driven through `Scheduler.add` / `schedule` alone."""

from __future__ import annotations

import time

import pytest
import torch

from hf_paged_kv import KVPool
from hf_paged_kv.engine import Limits, runner
from hf_paged_kv.engine.costs import StepCosts
from hf_paged_kv.engine.request import Request, SamplingParams
from hf_paged_kv.engine.scheduler import Scheduler
from hf_paged_kv.pool import LayerSpec
from hf_paged_kv.reuse.prefix_index import PUBLIC_TENANT
from hf_paged_kv.cache.sequence import Sequence

MODEL = "test-model"  # the weights' fingerprint, as the engine passes it


def scheduler(num_blocks=256, block_size=4, seconds_per_token=0.001, ttft_target=None):
    pool = KVPool(num_blocks=num_blocks, block_size=block_size)
    pool.bind([LayerSpec(2, 8, torch.device("cpu"))], torch.float32)
    made = Scheduler(pool, Limits(ttft_target=ttft_target))
    made.stepped(1, seconds_per_token, whole=True)  # the recent cost of a token, no fixed cost per step
    made.stepped(100, 100 * seconds_per_token, whole=True)
    return made


def queue(made: Scheduler, length: int, arrived: float, priority: int = 0, first: int = 3) -> Request:
    request = Request(list(range(first, first + length)), SamplingParams(max_new_tokens=4), priority=priority)
    request.arrived = arrived
    made.add(request)
    return request


def cache_prefix(made: Scheduler, owner: str = "default") -> list[int]:
    """80 tokens in 20 cached blocks of `owner`, as an earlier request leaves them."""
    cached = list(range(3, 83))
    blocks = made.pool.allocate(20)
    made.pool.reuse.index_sequence(MODEL, owner, Sequence(blocks=blocks, length=80, tokens=cached,
                                                          history=bytearray(b"\x01" * 80)), 0)
    made.pool.decref(blocks)
    return cached


def step(made: Scheduler, budget: int = 10_000, ends_prompts: bool = False, model: str = MODEL):
    """One step's plan with `budget` tokens left after the running part; with `ends_prompts`,
    that part ends a prompt (a one-token prompt already running, gone after the step)."""
    ending = None
    if ends_prompts:
        ending = Request([5], SamplingParams(max_new_tokens=4))
        made.running.append(ending)  # as admission leaves a request: running, nothing computed yet
    made.limits.max_batch_tokens = budget + ends_prompts
    plan = made.schedule(model)
    if ending is not None:
        plan.batch = [(request, n) for request, n in plan.batch if request is not ending]
        made.finish(ending, "cancelled")
    return plan


def admitted(made: Scheduler, budget: int = 10_000, ends_prompts: bool = False, model: str = MODEL) -> list[Request]:
    """The waiting requests one step admits (see `step`); their forward is taken to have run
    (the tokens fed stored), so they feed nothing more until a token is sampled."""
    waiting = list(made.waiting)
    plan = step(made, budget, ends_prompts, model)
    runner.commit(plan.batch)
    return [request for request, _ in plan.batch if request in waiting]


def test_a_burst_is_admitted_shortest_prompt_first():
    made, now = scheduler(), time.monotonic()
    long, short, middle = (queue(made, n, now, first=100 * i) for i, n in enumerate((120, 10, 50)))
    assert admitted(made) == [short, middle, long]


def test_a_long_prompt_keeps_its_turn_against_requests_arriving_after_its_compute_time():
    made, now = scheduler(seconds_per_token=0.001), time.monotonic()
    long = queue(made, 120, now - 0.5)  # 0.12 s of compute, arrived 0.5 s before the short one
    short = queue(made, 10, now, first=500)
    assert admitted(made) == [long, short]


def test_without_a_target_the_oldest_of_a_late_queue_goes_first():
    made, now = scheduler(seconds_per_token=0.001), time.monotonic()
    late = queue(made, 10, now - 1.0)  # waited 1 s
    fresh = queue(made, 120, now, first=500)
    assert admitted(made) == [late, fresh]


def test_priority_comes_first():
    made, now = scheduler(seconds_per_token=0.001), time.monotonic()
    old = queue(made, 10, now - 1.0)
    high = queue(made, 10, now, priority=1, first=300)
    assert admitted(made) == [high, old]


def test_with_a_target_a_partial_chunk_waits_for_a_forward_without_first_tokens():
    """A forward that already ends prompts takes no partial chunk of another when the chunk
    would delay their first tokens by more than a tenth of the target, and nothing behind it in
    the order is admitted (not even a request of its priority that fits, as memory would let
    pass). A cheap chunk is not deferred, and without a target the budget is filled."""
    def burst(ttft_target):
        made, now = scheduler(seconds_per_token=0.001, ttft_target=ttft_target), time.monotonic()
        short, middle, long_ = (queue(made, n, now, first=100 * i) for i, n in enumerate((10, 20, 60)))
        later = queue(made, 5, now + 0.2, first=400)  # after long_ in the order, fits what is left
        return made, short, middle, long_, later
    made, short, middle, long_, later = burst(ttft_target=0.1)  # 20 tokens x 1 ms > 0.01 s
    assert admitted(made, budget=50) == [short, middle]
    assert admitted(made, budget=50) == [long_]  # a forward without first tokens: it starts
    made, short, middle, long_, later = burst(ttft_target=0.05)  # 8 tokens x 1 ms > 0.005 s
    assert admitted(made, budget=8, ends_prompts=True) == []  # the running part ends a prompt already
    assert admitted(made, budget=8) == [short]  # a forward of decodes only: it starts
    made, short, middle, long_, later = burst(ttft_target=5.0)  # a 0.02 s delay against 5 s: not worth a forward
    assert admitted(made, budget=50) == [short, middle, long_]
    made, short, middle, long_, later = burst(ttft_target=None)
    assert admitted(made, budget=50) == [short, middle, long_]


def test_a_deferral_counts_cached_prefixes_and_leaves_the_pool_untouched():
    """Whether a prompt's chunk is partial is judged on what it would inherit; deferring it
    references, touches and counts nothing. A resumed request is never deferred."""
    made, now = scheduler(seconds_per_token=0.001, ttft_target=0.05), time.monotonic()
    cached = cache_prefix(made, "default")
    follow_up = Request(cached + [7] * 8, SamplingParams(max_new_tokens=4))  # 8 tokens to compute
    follow_up.arrived = now
    made.add(follow_up)
    assert admitted(made, budget=10, ends_prompts=True) == [follow_up] and follow_up.inherited == 80
    long_ = queue(made, 40, now, first=900)  # nothing cached: 40 tokens
    before = made.pool.stats()
    assert admitted(made, budget=10, ends_prompts=True) == []
    assert made.pool.stats() == before and long_.sequence.blocks == [] and long_.computed == 0
    long_.generated = [5]  # as if preempted after its first token: resuming is never deferred
    assert admitted(made, budget=10, ends_prompts=True) == [long_]


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
    made, now = scheduler(), time.monotonic()
    cached = cache_prefix(made, owner)
    fresh = queue(made, 40, now, first=900)
    follow_up = Request(cached + [7] * 8, SamplingParams(max_new_tokens=4))  # 88 tokens, 8 of them to compute
    follow_up.arrived = now
    made.add(follow_up)
    assert admitted(made) == [follow_up, fresh]
    assert follow_up.inherited == 80


def test_a_prompt_cached_whole_still_computes_the_block_of_its_last_token():
    """Inheriting stops before the block holding the last token (its logits are needed): a
    prompt that is exactly a cached prefix computes that block, and `uncached` says so."""
    made, now = scheduler(), time.monotonic()
    cached = cache_prefix(made)
    admitted(made)  # takes the weights' fingerprint, as the engine's first admitting step does
    whole = queue(made, 80, now)  # the 80 cached tokens, 20 blocks of 4
    longer = Request(cached + [7] * 8, SamplingParams(max_new_tokens=4), arrived=now)
    assert (made.uncached(whole), made.uncached(longer)) == (4, 8)
    assert admitted(made) == [whole] and whole.inherited == 76


def hold(made: Scheduler, blocks: int) -> None:
    """Occupy `blocks` of the pool, as running sequences would."""
    made.pool.allocate(blocks)


def test_a_request_memory_turns_away_is_passed_by_no_one():
    """Letting later requests that fit pass it (backfill) showed no gain in the ablation."""
    made, now = scheduler(num_blocks=16), time.monotonic()
    hold(made, 10)
    big = queue(made, 30, now - 0.2)  # 8 blocks: does not fit beside the 10 held
    small = queue(made, 6, now, first=500)  # 2 blocks: would fit
    assert admitted(made) == []
    assert made.waiting == [big, small]


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


def preempted_midway(made: Scheduler, request: Request, computed: int) -> None:
    """Admit `request`, store its first `computed` tokens as a forward would, then preempt it."""
    assert admitted(made, budget=computed) == [request]
    made.preempt(request)


def test_a_prefill_preempted_midway_counts_the_tokens_it_inherits_beyond_what_it_computed():
    """It stored 16 of its 100 tokens; another computed the first 80 meanwhile: coming back, it
    inherits 64 prompt tokens no forward of its own computed, and they are counted."""
    made = scheduler()
    request = queue(made, 100, time.monotonic())
    preempted_midway(made, request, 16)
    cache_prefix(made)
    plan = step(made)
    assert [r for r, _ in plan.batch] == [request]
    assert request.inherited == 80 and plan.inherited == 64
    assert runner.token_kinds([(request, 20)]) == (20, 0)  # the rest of its prompt: computed for the first time


def test_a_swapped_partial_block_is_not_restored_under_other_weights():
    """A request preempted with its prompt's 3 tokens in a partial block keeps their K/V on the
    host; if the weights change while it waits, they are stale: it computes them again."""
    for model, restored in ((MODEL, 3), ("other-weights", 0)):
        made = scheduler()
        made.stepped(1, 0.5, whole=True)  # recomputing looks expensive: the partial block is swapped
        request = queue(made, 3, time.monotonic())
        assert admitted(made) == [request]
        request.generated.append(7)  # its first token, sampled from that forward
        assert made.preempt(request) == "swap" and request.swapped is not None
        assert [r for r, _ in step(made, model=model).batch] == [request]
        assert request.computed == request.sequence.length == restored and request.swapped is None
