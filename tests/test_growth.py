"""The admission reserve's share: SGLang's decaying rule, capped by what finished requests used."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, assert_pool_clean, make_model

import hf_paged_kv
from hf_paged_kv import Engine, KVPool
from hf_paged_kv.engine.growth import TRUST_AFTER, WINDOW, GrowthShare
from hf_paged_kv.engine.request import Request, SamplingParams
from hf_paged_kv.engine import Limits
from hf_paged_kv.engine.scheduler import Scheduler
from hf_paged_kv.pool import LayerSpec


def finish(share: GrowthShare, used: float, times: int = TRUST_AFTER) -> None:
    for _ in range(times):
        share.finished(used)


def test_the_rule_alone_until_enough_requests_have_finished():
    share = GrowthShare(Limits(growth_ratio_init=0.7, growth_ratio_decay=0.1))
    finish(share, 0.05, TRUST_AFTER - 1)
    share.step()
    assert share.estimate is None and share.ratio == pytest.approx(0.6)
    share.finished(0.05)
    assert share.estimate == pytest.approx(0.05)
    assert share.ratio == pytest.approx(0.1)  # the estimate is below the least share


def test_the_estimate_caps_the_rule_and_never_raises_it():
    share = GrowthShare(Limits(growth_ratio_min=0.0, growth_ratio_decay=0.1))
    finish(share, 0.2)
    assert share.ratio == pytest.approx(0.2)
    for _ in range(6):
        share.step()
    assert share.ratio == pytest.approx(0.1)  # the rule decayed below it: the rule
    share = GrowthShare(Limits(growth_ratio_min=0.0))
    finish(share, 1.0)  # requests that used their whole allowance: no more than SGLang's start
    assert share.ratio == pytest.approx(0.7)


def test_a_preemption_goes_back_to_the_rule_until_fresh_requests_finish():
    share = GrowthShare(Limits(growth_ratio_min=0.0))
    finish(share, 0.1)
    share.preempted()
    assert share.estimate is None and share.ratio == pytest.approx(0.7)
    finish(share, 0.3, TRUST_AFTER - 1)
    assert share.ratio == pytest.approx(0.7)
    share.finished(0.3)
    assert share.ratio == pytest.approx((TRUST_AFTER * 0.1 + TRUST_AFTER * 0.3) / (2 * TRUST_AFTER))


def test_the_estimate_averages_the_last_window_of_requests():
    share = GrowthShare(Limits(growth_ratio_min=0.0))
    finish(share, 0.6, WINDOW)
    finish(share, 0.2, WINDOW - 4)
    assert share.estimate == pytest.approx((4 * 0.6 + (WINDOW - 4) * 0.2) / WINDOW)


def test_the_least_share_holds_even_when_raised_live():
    """The load controller raises `growth_ratio_min` under pressure: it applies at once."""
    limits = Limits(growth_ratio_min=0.1)
    share = GrowthShare(limits)
    finish(share, 0.0)
    assert share.ratio == pytest.approx(0.1)
    limits.growth_ratio_min = 0.5
    assert share.ratio == pytest.approx(0.5)


def test_without_outputs_the_rule_alone():
    share = GrowthShare(Limits(growth_from_outputs=False))
    finish(share, 0.0, WINDOW)
    assert share.estimate is None and share.ratio == pytest.approx(0.7)


def test_a_share_must_be_a_fraction():
    with pytest.raises(ValueError, match=r"a share of the allowance is in \[0, 1\], got 1.5"):
        GrowthShare(Limits()).finished(1.5)


@pytest.mark.parametrize("max_new, generated, used", [
    (4000, 8, 8 / 32),  # the allowance counted like the reserve: an eighth of the pool, 32 tokens
    (16, 8, 0.5),
    (4000, 40, 1.0),  # past the counted allowance: all of it
])
def test_a_finished_request_counts_the_share_of_its_counted_allowance(max_new, generated, used):
    pool = KVPool(num_blocks=64, block_size=4)
    pool.bind([LayerSpec(2, 8, torch.device("cpu"))], torch.float32)
    scheduler = Scheduler(pool, Limits())
    request = Request([3] * 8, SamplingParams(max_new_tokens=max_new))
    request.generated = [5] * generated
    for _ in range(TRUST_AFTER):
        scheduler.finish(request, "finished")
    assert scheduler.growth.estimate == pytest.approx(used)


def burst(learn: bool) -> tuple[int, list[list[int]]]:
    """Eight requests that stop at their first token teach the engine that outputs are short;
    then a burst of 16 arrives at once: the most sequences that ran together, and the outputs."""
    model = make_model("llama", seed=5)
    limits = Limits(growth_from_outputs=learn, growth_ratio_min=0.0, max_batch_tokens=512)
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8), limits=limits, controller=False)
    stop_at_once = list(range(VOCAB))  # every token ends the request
    prompt = lambda i: torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(i)).tolist()  # noqa: E731
    with engine:
        for i in range(TRUST_AFTER):
            engine.submit(prompt(i), max_new_tokens=64, eos_token_id=stop_at_once).result(timeout=60)
    assert engine.stats()["growth_ratio"] == pytest.approx(1 / 64 if learn else 0.7 - TRUST_AFTER * 0.002)
    engine.accepting = True  # queued before the loop starts: one burst
    handles = [engine.submit(prompt(100 + i), max_new_tokens=64, eos_token_id=stop_at_once) for i in range(16)]
    with engine:
        outputs = [handle.result(timeout=60) for handle in handles]
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)
    return engine.stats()["max_running"], outputs


def test_a_burst_runs_more_sequences_at_once_once_outputs_are_known_to_be_short():
    """Under SGLang's rule alone each running request keeps 0.7 x 64 tokens free for growth
    that never comes; with the estimate, the burst fills the pool."""
    learned, learned_outputs = burst(learn=True)
    rule, rule_outputs = burst(learn=False)
    assert learned_outputs == rule_outputs
    assert rule <= 8 and learned == 16
