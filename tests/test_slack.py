"""Lending a decode's blocks to a request about to miss its first-token target: who lends, who
waits for whom, and an engine whose lender and borrower both still give `generate`'s tokens."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import assert_pool_clean, make_model
from test_admission import admission, admitted, queue
from test_engine import prompts
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import Engine, KVPool
from hf_paged_kv.engine import SLO
from hf_paged_kv.engine.request import Request, SamplingParams
from hf_paged_kv.engine.scheduler import Limits, Scheduler
from hf_paged_kv.engine.slack import lend, lender, slack
from hf_paged_kv.pool import LayerSpec
from hf_paged_kv.sequence import Sequence


def decoding(tokens: int, since: float, blocks: list[int], priority: int = 0, prompt: int = 8,
             now: float | None = None) -> Request:
    """A running request that has generated `tokens`, its first `since` seconds before `now`,
    holding `blocks`."""
    request = Request(list(range(3, 3 + prompt)), SamplingParams(max_new_tokens=64), priority=priority)
    request.generated = list(range(10, 10 + tokens))
    request.computed = prompt + tokens - 1  # its last token is the next one fed: a decode
    request.sequence = Sequence(blocks=blocks, length=request.computed, tokens=request.tokens()[: request.computed],
                                history=bytearray(b"\x01" * request.computed))
    request.first_token = (time.monotonic() if now is None else now) - since
    return request


def scheduler_with(running: list[Request], ttft=1.0, per_token=0.5) -> Scheduler:
    pool = KVPool(num_blocks=64, block_size=4)
    pool.bind([LayerSpec(2, 8, torch.device("cpu"))], torch.float32)
    scheduler = Scheduler(pool, Limits(ttft_target=ttft, per_token_target=per_token, growth_ratio_init=0.0))
    scheduler.running = list(running)
    return scheduler


def test_slack_is_the_time_its_tokens_saved_against_the_targets_pace():
    now = time.monotonic()
    assert slack(decoding(5, since=1.0, blocks=[], now=now), now, 0.5) == pytest.approx(0.5 * 4 - 1.0)
    assert slack(decoding(5, since=3.0, blocks=[], now=now), now, 0.5) == pytest.approx(-1.0)  # behind
    assert slack(decoding(1, since=0.0, blocks=[], now=now), now, 0.5) == 0.0  # no mean before a second token


def test_the_lender_is_the_decode_with_the_most_spare_slack_that_frees_enough():
    refcount = np.zeros(64, dtype=np.int32)
    refcount[:40] = 1
    refcount[30:34] = 2  # shared with another sequence: preempting one owner frees none of them
    borrower = Request([3] * 20, SamplingParams(max_new_tokens=8))
    # pause: the 1 s TTFT target and the recompute of its tokens (12 and 20 here, at 1 ms each)
    little = decoding(4, since=0.1, blocks=list(range(0, 5)))  # 1.4 s of slack: 0.39 s spare
    most = decoding(12, since=1.0, blocks=list(range(5, 10)))  # 4.5 s of slack: 3.48 s spare
    shared = decoding(30, since=1.0, blocks=list(range(30, 34)))  # the most slack, but frees too little
    higher = decoding(30, since=1.0, blocks=list(range(10, 15)), priority=1)  # above the borrower's priority
    prefilling = decoding(30, since=1.0, blocks=list(range(15, 20)))
    prefilling.computed -= 5  # still feeding tokens
    lent = decoding(30, since=1.0, blocks=list(range(20, 25)))
    lent.lent_until = 1.0  # it lent once: never again
    scheduler = scheduler_with([little, most, shared, higher, prefilling, lent])
    now, none = time.monotonic(), np.array([], dtype=np.int64)
    assert lender(scheduler, borrower, 6, now, 0.001, refcount, none) is most
    # blocks in the borrower's own prefix it would take straight back: they free nothing
    assert lender(scheduler, borrower, 6, now, 0.001, refcount, np.array([5])) is little
    scheduler.running = [little, shared, higher, prefilling, lent]
    assert lender(scheduler, borrower, 6, now, 0.001, refcount, none) is little
    # each frees its 5 blocks and the one block of its reserve (no growth share at ratio 0)
    assert lender(scheduler, borrower, 7, now, 0.001, refcount, none) is None
    # recomputing its own tokens counts in the pause: at 0.1 s a token, its 12 tokens eat its slack
    assert lender(scheduler, borrower, 6, now, 0.1, refcount, none) is None


def test_a_lender_waits_for_its_borrower_for_one_target_at_most():
    admit, now = admission(seconds_per_token=0.001, ttft_target=1.0), time.monotonic()
    borrower = queue(admit, 30, now, first=500)
    lender_ = queue(admit, 10, now - 1.0)
    lender_.preemptions, lender_.generated = 1, [7, 8]  # it was running: preempted, its priority raised
    lender_.lent_to, lender_.lent_until = borrower, now + 1.0
    assert admitted(admit) == [borrower]  # the lender goes first by priority, but yields
    assert admitted(admit) == [lender_]  # its borrower is in: it resumes
    again = queue(admit, 30, now, first=900)
    late = queue(admit, 10, now - 1.0, first=700)
    late.preemptions, late.generated = 1, [7, 8]
    late.lent_to, late.lent_until = again, now - 0.01  # its borrower still waits, but past the bound
    assert admitted(admit)[0] is late


def test_lend_preempts_the_lender_and_its_borrower_goes_first():
    admit, now = admission(num_blocks=16, seconds_per_token=0.001, ttft_target=1.0), time.monotonic()
    admit.scheduler.limits.per_token_target = 0.5
    # 39 tokens in 10 of the 16 blocks; 3.5 s of slack against a pause of 1.05 s
    lender_ = decoding(10, since=1.0, blocks=admit.pool.allocate(10), prompt=30)
    admit.scheduler.running.append(lender_)
    borrower = queue(admit, 30, now, first=500)  # 8 blocks, and the lender's growth reserve: refused
    assert admitted(admit) == [] and admit.blocked is borrower
    assert lend(admit, [(lender_, 1)], admit.preempt) == []
    assert lender_ in admit.scheduler.waiting and lender_.lent_to is borrower and borrower.borrowed
    assert admitted(admit) == [borrower]  # the lender stays out while its borrower waits
    assert lend(admit, [], admit.preempt) == [] and admit.borrower is None  # nothing left to lend for


@pytest.mark.parametrize("case", ["too late", "no per-token target", "borrowed before"])
def test_no_lending_where_it_cannot_help(case):
    admit, now = admission(num_blocks=16, seconds_per_token=0.001, ttft_target=1.0), time.monotonic()
    admit.scheduler.limits.per_token_target = None if case == "no per-token target" else 0.5
    lender_ = decoding(10, since=1.0, blocks=admit.pool.allocate(10), prompt=30)
    admit.scheduler.running.append(lender_)
    borrower = queue(admit, 30, now - (2.0 if case == "too late" else 0.0), first=500)
    borrower.borrowed = case == "borrowed before"
    assert admitted(admit) == [] and admit.blocked is borrower
    batch = [(lender_, 1)]
    assert lend(admit, batch, admit.preempt) == batch and admit.scheduler.running == [lender_]


def engine_outputs(controller: bool, slo: SLO | None):
    """A decode holding most of a small pool; a second request submitted once it has streamed a
    few tokens, which memory turns away beside it. Returns both outputs, their timings and the
    engine's stats."""
    model = make_model("llama", seed=5)
    model.generation_config.eos_token_id = None  # both run to max_new_tokens
    long_prompt, short_prompt = prompts([30, 18], seed=30)
    expected = []
    for prompt, new in ((long_prompt, 120), (short_prompt, 6)):
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(),
                             max_new_tokens=new, do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    limits = Limits(max_batch_tokens=64, growth_ratio_init=1.0, growth_ratio_min=1.0)  # reserve all it may generate
    engine = Engine(model, pool=KVPool(num_blocks=40, block_size=4), limits=limits, controller=controller, slo=slo)
    with engine:
        first = engine.submit(long_prompt, max_new_tokens=120)
        stream = first.stream()
        for _ in range(4):  # it decodes: it has slack to lend
            next(stream)
        second = engine.submit(short_prompt, max_new_tokens=6)
        results = [first.result(timeout=120), second.result(timeout=120)]
    assert results == expected
    assert engine.stats()["requests_failed"] == 0
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)
    return first.request, second.request, engine.stats()


def test_a_decode_with_slack_lends_its_blocks_and_both_give_generates_tokens():
    """The long request's reserve for its 120 tokens leaves no room for the short one; with
    generous targets it lends its blocks: the short one streams before the long one ends, and
    the long one resumes with its own tokens."""
    long, short, stats = engine_outputs(True, SLO(ttft=30.0, per_token=30.0))
    assert stats["preemptions_lent"] == 1 and stats["preemptions"] == 1
    assert short.first_token < long.last_token


def test_without_targets_no_decode_lends():
    long, short, stats = engine_outputs(False, None)
    assert stats["preemptions_lent"] == 0 and stats["preemptions"] == 0
    assert short.first_token > long.last_token  # it waited for the long one's blocks
