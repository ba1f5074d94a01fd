"""A forward carrying decodes holds no more prefill than they can afford against their per-token
target: the budget follows the decodes' slack on the fitted cost line, and an engine that paces
still gives `generate`'s tokens."""

from __future__ import annotations

import time

import pytest
from conftest import assert_pool_clean, make_model
from test_engine import NEW, alone, prompts
from test_yielding import decoding

from hf_paged_kv import Engine, KVPool
from hf_paged_kv.engine.costs import StepCosts
from hf_paged_kv.engine.pacing import MARGIN, step_budget
from hf_paged_kv.engine.scheduler import Limits


def costs_of(fixed: float, per_token: float) -> StepCosts:
    costs = StepCosts()
    for tokens in (4, 40, 120, 250, 8, 60):
        costs.record(tokens, fixed + per_token * tokens)
    return costs


def test_tokens_within_reads_the_fitted_line():
    costs = costs_of(0.05, 0.001)
    assert costs.tokens_within(0.25) == pytest.approx(200, abs=1)
    assert costs.tokens_within(0.04) < 0  # the fixed cost alone takes longer
    assert StepCosts().tokens_within(1.0) is None  # no steps, no line
    alike = StepCosts()
    alike.record(10, 0.1)
    alike.record(12, 0.1)
    assert alike.tokens_within(1.0) is None  # no spread of step sizes: no slope


def test_a_fresh_decode_caps_the_forward_at_its_target():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    limits = Limits(max_batch_tokens=512, per_token_target=0.3)
    fresh = decoding(1, since=0.0, now=now)  # its first token just came: its second is due within 0.3 s
    assert step_budget([fresh], limits, costs, now) == costs.tokens_within(MARGIN * 0.3)
    assert step_budget([fresh], limits, costs, now) < 512


def test_decodes_ahead_of_their_target_cap_nothing():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    limits = Limits(max_batch_tokens=512, per_token_target=0.3)
    ahead = decoding(40, since=2.0, now=now)  # 40 tokens in 2 s: 10 s of its target's pace left
    assert step_budget([ahead], limits, costs, now) == 512
    behind = decoding(5, since=3.0, now=now)  # already behind: it may still have one target per step
    assert step_budget([ahead, behind], limits, costs, now) == costs.tokens_within(MARGIN * 0.3)


def test_without_a_target_or_decodes_the_budget_is_the_configured_one():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    fresh = decoding(1, since=0.0, now=now)
    assert step_budget([fresh], Limits(max_batch_tokens=512), costs, now) == 512
    prefilling = decoding(1, since=0.0, now=now)
    prefilling.computed -= 4  # still feeding its prompt: not a decode
    assert step_budget([prefilling], Limits(max_batch_tokens=512, per_token_target=0.3), costs, now) == 512
    assert step_budget([fresh], Limits(max_batch_tokens=512, per_token_target=0.3), StepCosts(), now) == 512


def test_the_decodes_always_fit():
    now, costs = time.monotonic(), costs_of(0.05, 0.001)
    decodes = [decoding(1, since=0.0, now=now) for _ in range(8)]
    assert step_budget(decodes, Limits(max_batch_tokens=512, per_token_target=0.01), costs, now) == 8


@pytest.mark.parametrize("per_token_target", [None, 1e-6])
def test_an_engine_whose_decode_cannot_afford_prefill_starts_the_next_prompt_after_it(per_token_target):
    """With a per-token target no forward can meet, a decoding request's forwards carry it alone:
    a long prompt arriving meanwhile starts when it ends (without a target, at once), and its
    tokens are still `generate`'s."""
    model = make_model("llama", seed=3)
    first, second = prompts([20, 200], seed=5)
    expected = alone(model, second)
    engine = Engine(model, pool=KVPool(num_blocks=96, block_size=8),
                    limits=Limits(max_batch_tokens=512, per_token_target=per_token_target), controller=False)
    for tokens in (1, 200) * 16:  # a steep cost line, fitted before the engine's own steps come in
        engine.admission.costs.record(tokens, 0.01 * tokens)
    with engine:
        decoding = engine.submit(first, max_new_tokens=60, eos_token_id=[])
        next(iter(decoding.stream()))
        late = engine.submit(second, max_new_tokens=NEW)
        assert late.result(timeout=120) == expected
        decoding.result(timeout=120)
    starts_after_it = late.timings["first_token"] > decoding.timings["finished"]
    assert starts_after_it == (per_token_target is not None)
    assert_pool_clean(engine.pool)
