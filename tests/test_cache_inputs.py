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
    from hf_paged_kv.cache import planner

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


# ------------------------------------------------------------ the caller's own positions
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tokens_at_the_callers_own_positions_are_never_shared_nor_served_shared_kv(arch):
    """Block hashes say token ids only; K/V computed at other positions than generate's (each
    real token at its rank) would be another request's wrong KV: such a forward inherits nothing
    and offers nothing, and both sides equal DynamicCache."""
    model = make_model(arch, seed=2)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(7))
    mask, shifted = torch.ones_like(ids), torch.arange(20)[None] + 40
    plain, expected_shifted = (generate(model, ids, mask, DynamicCache(), **kw) for kw in ({}, {"position_ids": shifted}))
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    with PagedCache() as cache:  # the prompt's blocks are cached at positions 0..19
        generate(model, ids, mask, cache)
    with PagedCache() as cache:
        assert torch.equal(generate(model, ids, mask, cache, position_ids=shifted), expected_shifted)
        assert cache.inherited == [0]
    hf_paged_kv.disable(model)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    with PagedCache() as cache:  # a fresh pool: only the shifted forward's blocks could be cached
        generate(model, ids, mask, cache, position_ids=shifted)
    with PagedCache() as cache:
        assert torch.equal(generate(model, ids, mask, cache), plain)
        assert cache.inherited == [0]
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


# --------------------------------------------------- a later turn's mask over stored tokens
def chat(model, cache_factory, eos: int, first_turn: dict):
    """Two turns of a batched chat on one cache; the second rebuilds its mask as `ids != PAD`,
    so the pads generate appended after row 0's EOS (fed as tokens in turn 1) are masked."""
    ids, mask = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1)), torch.ones(2, 10, dtype=torch.long)
    mask[1, :3], ids[1, :3] = 0, PAD
    cache = cache_factory()
    torch.manual_seed(0)
    turn1 = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, eos_token_id=eos,
                           **({"do_sample": False} | first_turn))
    ids2 = torch.cat([turn1, torch.tensor([[11, 12, 13]] * len(turn1))], 1)
    turn2 = model.generate(input_ids=ids2, attention_mask=(ids2 != PAD).long(), past_key_values=cache,
                           max_new_tokens=6, min_new_tokens=6, do_sample=False)
    return turn1, turn2, cache


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
@pytest.mark.parametrize("first_turn", [{}, {"do_sample": True, "num_return_sequences": 2}], ids=["rows", "shared-rows"])
def test_a_later_turn_may_mask_tokens_an_earlier_one_stored(arch, first_turn):
    model = make_model(arch, seed=4)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, PAD
    torch.manual_seed(0)
    probe = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **({"do_sample": False} | first_turn))
    eos = int(probe[0, 11])  # row 0's second new token ends it: pads follow it for 6 steps
    turn1, expected, _ = chat(model, DynamicCache, eos, first_turn)
    assert (turn1[0, 12:] == PAD).all()  # the scenario holds: row 0 ended early
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=96, block_size=4))
    _, got, cache = chat(model, PagedCache, eos, first_turn)
    assert torch.equal(got, expected)
    fed = torch.cat([turn1[0], torch.tensor([11, 12, 13])])
    assert cache.row_lengths()[0] == int((fed != PAD).sum()) + 5  # the masked pads' K/V left the row
    cache.release()
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


def test_unmasking_a_pad_the_cache_never_stored_is_refused(llama):
    ids, mask = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2)), torch.ones(1, 12, dtype=torch.long)
    mask[0, :4] = 0
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32, block_size=4))
    with PagedCache() as cache:
        out = generate(llama, ids, mask, cache, new=2)
        with pytest.raises(PagedKVError, match="unmasks position 0 of row 0, a pad"):
            generate(llama, out, torch.ones_like(out), cache, new=2)
    assert_pool_clean(pool)
    hf_paged_kv.disable(llama)


def test_a_refused_mask_changes_no_row(llama):
    """Row 0's mask hides two stored tokens, row 1's unmasks its pads: refused, and row 0 is left
    as it was (all rows or none), so the turn can be retried with a good mask."""
    ids, mask = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1)), torch.ones(2, 10, dtype=torch.long)
    mask[1, :3], ids[1, :3] = 0, PAD
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64, block_size=4))
    with PagedCache() as cache:
        out = generate(llama, ids, mask, cache, new=3)
        lengths = cache.row_lengths()
        follow = torch.cat([out, torch.tensor([[5, 6]] * 2)], 1)
        bad = torch.ones_like(follow)
        bad[0, 2:4] = 0
        with pytest.raises(PagedKVError, match="unmasks position 0 of row 1"):
            generate(llama, follow, bad, cache, new=2)
        assert cache.row_lengths() == lengths
        good = torch.cat([mask, torch.ones(2, follow.shape[1] - 10, dtype=torch.long)], 1)
        generate(llama, follow, good, cache, new=2)
    assert_pool_clean(pool)
    hf_paged_kv.disable(llama)


def test_rows_a_later_mask_leaves_alone_stay_shareable(llama):
    """In the batched chat whose row 0 masks its trailing pads, row 1's conversation is at
    generate's positions: a fresh request of it inherits it (only the masked row stops sharing)."""
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, PAD
    probe = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=128, block_size=4))
    with PagedCache() as cache:
        turn1 = llama.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8,
                               eos_token_id=int(probe[0, 11]), do_sample=False)
        assert (turn1[0, 12:] == PAD).all()
        turn2_ids = torch.cat([turn1, torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))], 1)
        turn2 = generate(llama, turn2_ids, (turn2_ids != PAD).long(), cache, new=6)
    row1 = turn2[1][turn2[1] != PAD][None]
    with PagedCache() as cache:
        generate(llama, row1, torch.ones_like(row1), cache, new=1)
        assert cache.inherited == [(row1.shape[1] - 1) // 4 * 4]  # every full block: all it fed, all shared
    assert_pool_clean(pool)
    hf_paged_kv.disable(llama)
