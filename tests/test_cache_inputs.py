"""Inputs that change what the KV means without changing the token ids, and inputs that are
wrong: no reuse may carry KV across them, and a bad one gets a clear error."""

from __future__ import annotations

import pytest
import torch
from conftest import PAD, VOCAB, assert_pool_clean, make_model
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, PagedKVError


def generate(model, ids, mask, cache, new=6, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, **kwargs)


def holed_and_plain():
    """40 tokens as they are, and with a hole of 12 pads after the 10th (a sliding window of 24
    counts the pads, so from the hole on the K/V differ between the two)."""
    tokens = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    holed = torch.cat([tokens[:, :10], torch.full((1, 12), PAD), tokens[:, 10:]], 1)
    hole = torch.ones_like(holed)
    hole[:, 10:22] = 0
    return (holed, hole), (tokens, torch.ones_like(tokens))


def test_a_hole_in_the_mask_shares_nothing_past_it_under_a_sliding_window():
    """A request with a hole and one without share their tokens but not their K/V past the hole:
    in either order the second gives DynamicCache's tokens, and a cold batch holding both (the
    plain one left-padded to the same width) does too."""
    model = make_model("mistral", seed=3)  # sliding_window 24
    (holed, hole), (plain, full) = holed_and_plain()
    expected = {"holed": generate(model, holed, hole, DynamicCache()), "plain": generate(model, plain, full, DynamicCache())}
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=128, block_size=4))
    for order in (("holed", "plain"), ("plain", "holed")):
        pool.reuse.forget()
        for name in order:
            ids, mask = (holed, hole) if name == "holed" else (plain, full)
            with PagedCache() as cache:
                assert torch.equal(generate(model, ids, mask, cache), expected[name]), (order, name)
    padded = torch.cat([torch.full((1, 12), PAD), plain], 1)
    ids, mask = torch.cat([holed, padded]), torch.cat([hole, torch.cat([torch.zeros(1, 12, dtype=torch.long), full], 1)])
    expected = generate(model, ids, mask, DynamicCache())
    pool.reuse.forget()
    with PagedCache() as cache:
        assert torch.equal(generate(model, ids, mask, cache), expected)
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


def test_an_attention_mask_that_does_not_cover_the_input_is_refused_clearly():
    model = make_model("llama", seed=3)
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    narrow, one_row = torch.ones(2, 8, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)
    # one row plans alone; two rows go through the shared-prefix pre-pass first
    for rows, mask in ((ids[:1], narrow[:1]), (ids, narrow), (ids, one_row)):
        with pytest.raises(PagedKVError, match="does not cover the forward's"):
            generate(model, rows, mask, PagedCache())
    assert_pool_clean(hf_paged_kv.pool_of(model))
    hf_paged_kv.disable(model)


def test_an_interruption_while_a_forward_is_planned_leaves_no_block_behind(monkeypatch):
    """Only a full pool was undone before; any exception (an interrupt, a failing tier) now gives
    back every block the planning took."""
    from hf_paged_kv import planner

    model = make_model("llama", seed=3)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(4))
    with PagedCache() as cache:
        generate(model, ids, torch.ones_like(ids), cache)  # its prefix is cached now: the next one inherits it
    plan_batch = planner.plan_batch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(planner, "plan_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate(model, torch.cat([ids, ids[:, :5]], 1), torch.ones(1, 29, dtype=torch.long), PagedCache())
    monkeypatch.setattr(planner, "plan_batch", plan_batch)
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


@pytest.mark.parametrize("reuse", [True, False])
def test_token_types_are_part_of_what_the_kv_holds(reuse):
    """GPT-2 adds token type embeddings: equal ids with other token types are other K/V. A row
    is neither merged with an equal-id row of the same batch nor indexed, nor inherited by ids."""
    model = make_model("gpt2", seed=3)
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3)).repeat(2, 1)
    types = torch.stack([torch.zeros(24, dtype=torch.long), torch.ones(24, dtype=torch.long)])
    expected = generate(model, ids, torch.ones_like(ids), DynamicCache(), token_type_ids=types)
    alone = generate(model, ids[:1], torch.ones_like(ids[:1]), DynamicCache())
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    with PagedCache(reuse=reuse) as cache:
        assert torch.equal(generate(model, ids, torch.ones_like(ids), cache, token_type_ids=types), expected)
    with PagedCache() as cache:  # the same ids without token types: nothing to inherit from the batch
        assert torch.equal(generate(model, ids[:1], torch.ones_like(ids[:1]), cache), alone)
        assert cache.inherited == [0]
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)
