"""Running decodes with per-token slack yield their memory to a first token, swapped out to the
host tier: who yields, when nobody does, and an engine whose yielding decode and the request it
made room for both still give `generate`'s tokens."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import assert_pool_clean, make_model
from test_admission import MODEL, admitted, queue
from test_engine import prompts
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import Engine, KVPool
from hf_paged_kv.engine import SLO
from hf_paged_kv.engine.admission import Admission
from hf_paged_kv.engine.metrics import EngineMetrics
from hf_paged_kv.engine.request import Request, SamplingParams
from hf_paged_kv.engine import Limits
from hf_paged_kv.engine.scheduler import Scheduler
from hf_paged_kv.engine.yielding import slack, victims
from hf_paged_kv.pool import LayerSpec
from hf_paged_kv.sequence import Sequence


def decoding(tokens: int, since: float, blocks: list[int] = (), priority: int = 0, prompt: int = 8,
             now: float | None = None) -> Request:
    """A running request that has generated `tokens`, its first `since` seconds before `now`,
    holding `blocks` (its prompt's and generated tokens' KV, all but the last token's)."""
    request = Request(list(range(3, 3 + prompt)), SamplingParams(max_new_tokens=64), priority=priority)
    request.generated = list(range(500, 500 + tokens))
    request.computed = prompt + tokens - 1  # its last token is the next one fed: a decode
    request.sequence = Sequence(blocks=list(blocks), length=request.computed,
                                tokens=request.tokens()[: request.computed],
                                history=bytearray(b"\x01" * request.computed))
    request.first_token = (time.monotonic() if now is None else now) - since
    return request


def test_slack_is_the_pause_that_still_meets_the_per_token_target_with_one_more_token():
    now = time.monotonic()
    # 5 tokens at a 0.5 s target: the 6th may come 2.5 s after the first; 1 s passed, a step takes 0.1 s
    assert slack(decoding(5, since=1.0, now=now), 0.5, 0.1, now) == pytest.approx(1.4)
    assert slack(decoding(5, since=3.0, now=now), 0.5, 0.1, now) < 0  # already behind its target's pace


def test_victims_are_the_lowest_priority_then_the_most_slack_and_only_enough_of_them():
    now = time.monotonic()
    requester = Request([3] * 20, SamplingParams(max_new_tokens=8), priority=1)
    little = decoding(4, since=1.9, now=now)  # 0.1 s of slack at a 0.5 s target: too little
    some = decoding(8, since=1.0, now=now)  # 3.0 s
    most = decoding(12, since=1.0, now=now)  # 5.0 s
    first = decoding(6, since=1.0, priority=-1, now=now)  # 2.0 s, but the lowest priority
    higher = decoding(30, since=1.0, priority=2, now=now)  # above the requester's priority
    prefilling = decoding(30, since=1.0, now=now)
    prefilling.computed -= 5  # still feeding tokens
    raised = decoding(40, since=1.0, now=now)
    raised.preemptions = 2  # preempted twice when memory ran out: its effective priority is above the requester's
    ending = decoding(63, since=1.0, now=now)  # one token left of its 64: it frees its blocks anyway
    running = [little, some, most, first, higher, prefilling, raised, ending]

    def chosen(shortfall, frees=lambda request: 4):
        return victims(running, requester, shortfall, frees, 0.5, 2.0, 0.0, now)

    assert chosen(4) == [first]
    assert chosen(5) == [first, most]
    assert chosen(12) == [first, most, some]
    assert chosen(13) == []  # together they cannot make the room: nobody is swapped out for nothing
    assert chosen(0) == []  # it fits already
    assert victims(running, requester, 4, lambda request: 4, 0.5, 2.0, 0.0, now + 3.1) == []  # slack spent


def admission_with_host(host_blocks: int | None = 8, per_token_target: float | None = 0.5, ttft_target=1.0):
    pool = KVPool(num_blocks=16, block_size=4, host_blocks=host_blocks)
    pool.bind([LayerSpec(2, 8, torch.device("cpu"))], torch.float32)
    limits = Limits(ttft_target=ttft_target, per_token_target=per_token_target, growth_ratio_init=0.0,
                    growth_ratio_min=0.0)
    admit = Admission(pool, Scheduler(pool, limits))
    admit.costs.record(1, 0.001)
    admit.costs.record(100, 0.1)
    return admit


def running(admit: Admission, tokens: int, since: float, blocks: int, prompt: int) -> Request:
    """A decode holding `blocks` of the pool, its full blocks indexed (as the engine does)."""
    request = decoding(tokens, since, admit.pool.allocate(blocks), prompt=prompt)
    request.arrived = time.monotonic() - since - 1.0
    admit.pool.reuse.index_sequence(MODEL, request.tenant, request.sequence, 0)
    admit.scheduler.running.append(request)
    return request


def test_a_decode_with_slack_yields_to_a_request_memory_turns_away():
    admit, now = admission_with_host(), time.monotonic()
    decode = running(admit, 10, since=1.0, blocks=10, prompt=30)  # 39 tokens in 10 of 16 blocks; 3.9 s of slack
    newcomer = queue(admit, 30, now, first=700)  # 8 blocks, and 1 for the decode's reserve: 3 short
    assert admitted(admit) == [newcomer]
    assert decode in admit.scheduler.waiting and decode.yielded and decode.effective_priority == 0
    assert decode.swapped is not None  # its partial block waits in host memory
    assert admit.pool.stats()["host_blocks_used"] > 0  # full blocks the newcomer's evicted went to the host tier
    newcomer.computed, newcomer.generated = 30, [5]  # its forward ran
    later = queue(admit, 4, now, first=900)  # fits beside the newcomer, where the decode does not yet
    assert admitted(admit) == [later]  # the waiting decode, ahead in turn, holds no one back


def test_a_victim_frees_only_the_blocks_it_alone_holds_outside_the_requesters_prefix():
    admit, now = admission_with_host(), time.monotonic()
    decode = running(admit, 10, since=1.0, blocks=10, prompt=30)
    blocks = decode.sequence.blocks
    admit.pool.incref(blocks[:6])  # another sequence shares its first 6 blocks
    step = admit.costs.step_seconds()
    requester = queue(admit, 30, now, first=700)  # 8 blocks, and 1 for the decode's reserve: 3 short
    # the decode alone holds 4 blocks, and one of the reserve: 5 >= 3
    assert admit.scheduler.yielders(requester, [], set(), step, now) == [decode]
    assert admit.scheduler.yielders(requester, [], {decode}, step, now) == []  # admitted in this step
    # 47 tokens whose first 3 blocks are the decode's: 12 blocks, 3 of them inherited from the decode,
    # and 1 of the reserve: 4 short; outside that prefix the decode alone holds 1 block, with its
    # reserve 2: not enough (releasing its prefix blocks only turns them into ones to inherit)
    longer = Request(list(range(700, 747)), SamplingParams(max_new_tokens=4))
    assert admit.scheduler.yielders(longer, blocks[6:9], set(), step, now) == []
    # 39 tokens whose first 2 blocks are the decode's: 10 blocks, 2 inherited, 1 of the reserve: 3 short;
    # outside them the decode alone holds 2 blocks, with its reserve 3: enough
    shorter = Request(list(range(700, 739)), SamplingParams(max_new_tokens=4))
    assert admit.scheduler.yielders(shorter, blocks[6:8], set(), step, now) == [decode]
    admit.pool.decref(blocks[:6])


def test_an_idle_cached_prefix_spares_the_requester_nothing():
    """Inheriting an idle cached block takes one that counted as available: the room to make is
    what the requester lacks with its prefix counted as needed."""
    admit, now = admission_with_host(), time.monotonic()
    prefix = list(range(700, 712))  # 3 blocks, cached and idle, as an earlier request left them
    held = admit.pool.allocate(3)
    admit.pool.reuse.index_sequence(MODEL, "default", Sequence(blocks=held, length=12, tokens=prefix,
                                                               history=bytearray(b"\x01" * 12)), 0)
    admit.pool.decref(held)
    decode = running(admit, 10, since=1.0, blocks=10, prompt=30)  # 3 free blocks left
    requester = Request(prefix + list(range(800, 818)), SamplingParams(max_new_tokens=4))
    requester.arrived = now
    admit.scheduler.enqueue(requester)
    assert admitted(admit) == [requester] and decode.yielded
    assert requester.inherited == 12


def test_a_decode_back_in_this_step_is_not_swapped_out_again_in_it():
    admit, now = admission_with_host(), time.monotonic()
    decode = running(admit, 10, since=1.0, blocks=10, prompt=30)
    newcomer = queue(admit, 30, now, first=700)
    assert admitted(admit) == [newcomer] and decode.yielded
    admit.scheduler.running.remove(newcomer)  # it finished
    admit.pool.decref(newcomer.sequence.blocks)
    second = queue(admit, 30, now, first=900)
    assert admitted(admit) == [decode]  # back first; the second request does not take its room again
    assert decode in admit.scheduler.running and not decode.yielded and second in admit.scheduler.waiting


@pytest.mark.parametrize("spent_for, passes", [(None, True), (0.5, True), (5.0, False)])
def test_a_yielded_decode_holds_others_back_once_its_slack_is_spent_beyond_the_backfill_wait(spent_for, passes):
    """While it has slack, or for `backfill_wait` (1 s) after it ran out, a later request that fits
    passes the waiting decode; after that it takes its turn like any request memory turns away."""
    admit, now = admission_with_host(), time.monotonic()
    decode = running(admit, 10, since=1.0, blocks=10, prompt=30)  # 3.95 s of slack
    newcomer = queue(admit, 30, now, first=700)
    assert admitted(admit) == [newcomer] and decode.yielded
    newcomer.computed, newcomer.generated = 30, [5]  # its forward ran
    if spent_for is not None:
        decode.first_token -= 4.0 + spent_for  # its slack ran out `spent_for` seconds ago
    later = queue(admit, 4, now, first=900)
    assert admitted(admit) == ([later] if passes else [])


@pytest.mark.parametrize("yielding", [False, True])
def test_a_yielding_decode_keeps_its_partial_block_in_host_memory_whatever_a_copy_costs(yielding):
    admit = admission_with_host()
    decode = running(admit, 10, since=1.0, blocks=10, prompt=30)  # 3 tokens in its partial block
    admit.preemption.copy_seconds_per_block = 10.0  # a copy measured dearer than recomputing them
    mode = admit.preemption.preempt(decode, yielding=yielding)
    assert (mode, decode.swapped is not None) == (("swap", True) if yielding else ("recompute", False))
    assert decode.yielded is yielding and decode.effective_priority == (0 if yielding else 1)


@pytest.mark.parametrize("ends_prompts", [False, True])
def test_no_decode_yields_to_a_prompt_that_waits_for_a_later_forward_anyway(ends_prompts):
    """In a forward that ends prompts, a new prompt whose uncached part does not fit the budget
    waits for a later forward (`PARTIAL_DELAY`): swapping decodes out for it would be for nothing."""
    admit, now = admission_with_host(), time.monotonic()
    admit.costs.record(1, 0.01)  # a token costs 10 ms at the margin: a 20-token chunk delays others 0.2 s
    admit.costs.record(100, 1.0)
    decode = running(admit, 10, since=1.0, blocks=10, prompt=30)
    newcomer = queue(admit, 30, now, first=700)
    chosen = admit.admit(20, MODEL, EngineMetrics(), ends_prompts)
    assert [request for request, _ in chosen] == ([] if ends_prompts else [newcomer])
    assert decode.yielded is not ends_prompts


@pytest.mark.parametrize("case", ["no host tier", "no per-token target", "too late", "no slack"])
def test_nothing_yields_where_it_cannot_help(case):
    admit = admission_with_host(host_blocks=None if case == "no host tier" else 8,
                                per_token_target=None if case == "no per-token target" else 0.5)
    decode = running(admit, 10, since=4.5 if case == "no slack" else 1.0, blocks=10, prompt=30)
    queue(admit, 30, time.monotonic() - (1.5 if case == "too late" else 0.0), first=700)
    assert admitted(admit) == [] and admit.scheduler.running == [decode] and not decode.yielded


def engine_outputs(controller: bool, host_blocks: int | None = 16, cancel_long: bool = False):
    """A long decode holding most of a small pool; a request with a longer prompt submitted once
    it has streamed a few tokens, which memory turns away beside it. Returns both requests and the
    engine's stats; their outputs are `generate`'s (the long one's up to where it was cancelled,
    if `cancel_long`: as soon as the other streams)."""
    model = make_model("llama", seed=5)
    model.generation_config.eos_token_id = None  # both run to max_new_tokens
    long_prompt, other_prompt = prompts([30, 124], seed=30)
    expected = []
    for prompt, new in ((long_prompt, 120), (other_prompt, 24)):
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(),
                             max_new_tokens=new, do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    limits = Limits(max_batch_tokens=64, growth_ratio_init=1.0, growth_ratio_min=1.0,
                    growth_clip=None)  # reserve all it may generate
    pool = KVPool(num_blocks=40, block_size=4, host_blocks=host_blocks, pin_budget=0.0,
                  hot_threshold=None)  # every block for the two requests
    engine = Engine(model, pool=pool, limits=limits, controller=controller, slo=SLO(ttft=30.0, per_token=30.0))
    with engine:
        first = engine.submit(long_prompt, max_new_tokens=120)
        stream = first.stream()
        for _ in range(4):  # it decodes, and has slack to yield
            next(stream)
        second = engine.submit(other_prompt, max_new_tokens=24)
        if cancel_long:
            next(second.stream())
            first.cancel()
        results = [first.result(timeout=120), second.result(timeout=120)]
    if cancel_long:
        assert first.outcome == "cancelled" and results[0] == expected[0][: len(results[0])]
        results[0] = expected[0]
    assert results == expected
    stats = engine.stats()
    assert stats["requests_failed"] == 0
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)
    return first.request, second.request, stats


def test_a_decode_yields_to_a_first_token_and_both_give_generates_tokens():
    """The long request's reserve for its 120 tokens leaves no room for the other; with the
    controller's targets and a host tier, it steps out: the other streams before the long one
    ends, and the long one resumes with its own tokens, some of its blocks back from the host tier
    (the other's 32 blocks evicted them)."""
    long, other, stats = engine_outputs(controller=True)
    assert stats["preemptions_for_first_tokens"] >= 1 and stats["preemptions"] == stats["preemptions_for_first_tokens"]
    assert other.first_token < long.last_token
    assert long.preemptions == 0 and not long.yielded
    assert stats["hit_tokens_host"] > 0


def test_a_decode_cancelled_while_it_waits_after_yielding_leaves_nothing_behind():
    long, other, stats = engine_outputs(controller=True, cancel_long=True)
    assert stats["preemptions_for_first_tokens"] >= 1 and long.swapped is None


@pytest.mark.parametrize("controller, host_blocks", [(False, 16), (True, None)])
def test_without_targets_or_a_host_tier_no_decode_yields(controller, host_blocks):
    long, other, stats = engine_outputs(controller, host_blocks)
    assert stats["preemptions"] == 0
    assert other.first_token > long.last_token  # it waited for the long one's blocks
