"""Pinning: pinned prefixes survive any pressure, within a budget, until unpinned or expired."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, assert_pool_clean, greedy, make_model, manual_clock
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, PinBudgetError

BLOCK = 8


def tokens(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def model():
    model = make_model("llama", seed=41)
    yield model
    hf_paged_kv.disable(model)


def skip_of(model, prompt, **cache_kwargs):
    """How many prompt tokens a fresh request inherits (and its output)."""
    with PagedCache(**cache_kwargs) as cache:
        out = greedy(model, cache, prompt[None], torch.ones(1, len(prompt), dtype=torch.long), new_tokens=4)
        return cache.inherited[0], out


def test_pinned_prefix_survives_any_pressure(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=BLOCK, pin_budget=0.5))
    system = tokens(40, 1)
    pin = hf_paged_kv.pin(model, system)
    assert pin.blocks and len(pin.blocks) == 5
    for seed in range(2, 8):  # churn: one-off requests that fill the pool
        skip_of(model, tokens(60, seed))
    taken = pool.allocate(pool.num_available())  # everything evictable is gone
    assert hf_paged_kv.cached_tokens(model, system)["device"] == 40
    pool.decref(taken)
    prompt = torch.cat([system, tokens(5, 9)])
    skipped, out = skip_of(model, prompt)
    assert skipped == 40
    expected = greedy(model, DynamicCache(), prompt[None], torch.ones(1, 45, dtype=torch.long), new_tokens=4)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    hf_paged_kv.unpin(model, pin)
    assert pool.stats()["blocks_pinned"] == 0
    assert_pool_clean(pool)


def test_budget_holds_and_priority_displaces(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=40, block_size=BLOCK, pin_budget=0.25))  # 10 blocks
    low = hf_paged_kv.pin(model, tokens(48, 10), priority=0)
    with pytest.raises(PinBudgetError, match="exceeds the pin budget of 10 blocks"):
        hf_paged_kv.pin(model, tokens(48, 11), priority=0)
    assert pool.stats()["blocks_pinned"] == 6  # the failed pin changed nothing
    high = hf_paged_kv.pin(model, tokens(48, 11), priority=5)
    stats = pool.stats()
    assert [p["id"] for p in stats["pins"]] == [high.id] and stats["blocks_pinned"] == 6
    assert low.id not in [p["id"] for p in stats["pins"]]
    with pytest.raises(ValueError, match="fills no block"):
        hf_paged_kv.pin(model, tokens(5, 12))
    hf_paged_kv.unpin(model, high)
    assert_pool_clean(pool)


def test_pins_expire_at_their_ttl(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=BLOCK))
    clock = manual_clock(pool)
    hf_paged_kv.pin(model, tokens(40, 13), ttl=30)
    clock[0] = 29.0
    assert pool.stats()["blocks_pinned"] == 5 and pool.stats()["pins"][0]["expires_in"] == pytest.approx(1.0)
    clock[0] = 31.0
    assert pool.stats()["blocks_pinned"] == 0
    assert_pool_clean(pool)


def test_a_pin_ends_when_its_blocks_pass_the_pools_ttl(model):
    """Blocks past the pool's TTL are never offered again: a pin holding them only held memory."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=BLOCK, ttl=60))
    clock = manual_clock(pool)
    system = tokens(40, 13)
    hf_paged_kv.pin(model, system, ttl=3600)
    clock[0] = 59.0
    assert pool.stats()["blocks_pinned"] == 5 and pool.stats()["pins"][0]["expires_in"] == pytest.approx(1.0)
    clock[0] = 61.0
    assert pool.stats()["blocks_pinned"] == 0 and pool.stats()["pins"] == []
    assert skip_of(model, torch.cat([system, tokens(5, 14)]))[0] == 0
    assert_pool_clean(pool)


def test_pin_turns_pins_the_first_turns(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=48, block_size=BLOCK))
    cache = PagedCache(pin_turns=1)
    history = tokens(35, 14)
    for turn in range(3):
        ids = history[None]
        history = torch.cat([greedy(model, cache, ids, torch.ones_like(ids), new_tokens=4)[0], tokens(9, 20 + turn)])
        if turn == 0:
            assert pool.stats()["blocks_pinned"] == 0  # pinned once the second turn starts
    stats = pool.stats()
    assert [p["reason"] for p in stats["pins"]] == ["turns"]
    assert stats["pins"][0]["tokens"] == 32  # the first turn's 35 tokens: 4 whole blocks
    first_turn = cache.token_ids()[0][:32]
    cache.release()
    taken = pool.allocate(pool.num_available())
    assert hf_paged_kv.cached_tokens(model, first_turn)["device"] == 32  # survived the pressure
    pool.decref(taken)
    with pytest.raises(ValueError, match="pin_turns"):
        PagedCache(pin_turns=1, reuse=False)


def test_a_turn_of_assisted_decoding_is_one_turn(model):
    """Assisted decoding verifies several tokens per forward; the call is still one turn, so
    the first turn is pinned whole when the second begins, not after its first verification."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=48, block_size=BLOCK))
    assistant = make_model("llama", seed=42)
    with PagedCache(pin_turns=1) as cache:
        ids = tokens(30, 15)[None]
        reply = model.generate(input_ids=ids, past_key_values=cache, assistant_model=assistant, max_new_tokens=12,
                               do_sample=False)
        assert pool.stats()["blocks_pinned"] == 0
        follow = torch.cat([reply, tokens(5, 16)[None]], 1)
        # (assisted decoding itself does not continue a cache: transformers re-feeds the whole
        # conversation with a mask of its width, refused – see test_forward_calls)
        model.generate(input_ids=follow, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert [p["tokens"] for p in pool.stats()["pins"]] == [(reply.shape[1] - 1) // BLOCK * BLOCK]


def test_hot_prefix_is_pinned_automatically_and_cools_down(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=48, block_size=BLOCK, hot_threshold=3.0, half_life=10.0))
    clock = manual_clock(pool)
    system = tokens(41, 15)
    for i in range(4):
        clock[0] += 0.1
        skip_of(model, system)
    stats = pool.stats()
    assert [p["reason"] for p in stats["pins"]] == ["hot"] and stats["blocks_pinned"] == 5
    clock[0] += 60.0  # six half-lives later the prefix is cold: the next lookup unpins it
    skip_of(model, tokens(41, 16))
    assert pool.stats()["blocks_pinned"] == 0
    assert_pool_clean(pool)


def test_prefix_that_keeps_returning_under_churn_gets_pinned(model):
    """Evicted between uses, the prefix is recomputed each time; its access weight survives
    eviction (ghost list), so it is still recognised as hot and pinned."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=16, block_size=BLOCK, hot_threshold=2.5, pin_budget=0.5))
    hot = tokens(41, 17)
    skips = []
    for _ in range(3):
        skips.append(skip_of(model, hot)[0])
        pool.decref(pool.allocate(pool.num_available()))  # churn: everything evictable is evicted
    assert skips == [0, 0, 0]  # recomputed every time ...
    assert [p["reason"] for p in pool.stats()["pins"]] == ["hot"]  # ... but its weight (1, 2, 3) made it hot
    assert skip_of(model, hot)[0] == 40  # and the pin kept it through the last churn
    assert_pool_clean(pool)


def test_automatic_pins_over_budget_are_refused_counted_and_warned_once(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=40, block_size=BLOCK, pin_budget=0.1))  # 4 blocks
    explicit = hf_paged_kv.pin(model, tokens(32, 30), priority=5)  # fills the budget, nothing below it to displace
    outputs = []
    with pytest.warns(UserWarning) as caught:
        for seed in (31, 32):  # two conversations of two turns: each asks to pin its first turn
            with PagedCache(pin_turns=1) as cache:
                history = tokens(20, seed)
                for turn in range(2):
                    ids = history[None]
                    history = torch.cat([greedy(model, cache, ids, torch.ones_like(ids), new_tokens=3)[0],
                                         tokens(5, seed + 10 + turn)])
                outputs.append(history)
    refusals = [w for w in caught if "pin refused" in str(w.message)]
    assert len(refusals) == 1 and "exceeds the pin budget of 4 blocks" in str(refusals[0].message)
    stats = pool.stats()
    assert stats["pins_refused"] == 2 and [p["reason"] for p in stats["pins"]] == ["explicit"]
    for seed, output in zip((31, 32), outputs):  # a refused pin changes no token
        history = tokens(20, seed)
        for turn in range(2):
            ids = history[None]
            history = torch.cat([greedy(model, DynamicCache(), ids, torch.ones_like(ids), new_tokens=3)[0],
                                 tokens(5, seed + 10 + turn)])
        torch.testing.assert_close(output, history, rtol=0, atol=0)
    hf_paged_kv.unpin(model, explicit)
    assert_pool_clean(pool)


def test_a_refusal_after_a_budget_shrink_still_warns(model):
    """Pins that give way to a smaller budget are not refusals (they may come back), and the
    first refusal of an automatic pin afterwards still warns (once)."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=40, block_size=BLOCK, pin_budget=0.25))  # 10 blocks
    explicit = hf_paged_kv.pin(model, tokens(64, 40), priority=5)  # 8 blocks
    with pool.locked():
        pool.tune(pin_budget=0.1)  # 4 blocks, as the load controller does: the pin gives way
    assert pool.stats()["pins_refused"] == 0 and pool.stats()["pins_given_way"] == 1
    assert pool.stats()["blocks_pinned"] == 0
    explicit = hf_paged_kv.pin(model, tokens(32, 41), priority=5)  # 4 blocks: the budget is full again
    with pytest.warns(UserWarning, match="pin refused"):
        with PagedCache(pin_turns=1) as cache:
            history = tokens(20, 42)[None]
            for turn in range(2):
                history = torch.cat([greedy(model, cache, history, torch.ones_like(history), new_tokens=3),
                                     tokens(5, 43 + turn)[None]], dim=1)
    assert pool.stats()["pins_refused"] == 1
    hf_paged_kv.unpin(model, explicit)
    assert_pool_clean(pool)


def test_pins_that_give_way_again_and_again_are_not_refusals_until_their_kv_is_gone(model):
    """The controller halves the budget in every pressure spell: a pin that gives way and comes
    back each time was never refused; one whose blocks left the device meanwhile is lost."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=40, block_size=BLOCK, pin_budget=0.25))  # 10 blocks
    prefix = tokens(64, 50)
    pinned = hf_paged_kv.pin(model, prefix, priority=5)  # 8 blocks
    for _ in range(3):
        with pool.locked():
            pool.tune(pin_budget=0.1)
        assert pool.stats()["pins_given_way"] == 1 and pool.stats()["blocks_pinned"] == 0
        with pool.locked():
            pool.tune(pin_budget=0.25)
        assert pool.stats()["blocks_pinned"] == 8 and pool.stats()["pins_refused"] == 0
    with pool.locked():
        pool.tune(pin_budget=0.1)
    pool.make_free(pool.num_blocks)  # the given-way pin's blocks leave the device
    with pool.locked():
        pool.tune(pin_budget=0.25)
    assert pool.stats()["pins_given_way"] == 0 and pool.stats()["pins_refused"] == 1
    assert pool.stats()["blocks_pinned"] == 0
    hf_paged_kv.unpin(model, pinned)
    assert_pool_clean(pool)


def test_pins_that_gave_way_to_a_smaller_budget_come_back(model):
    """The load controller halves the pin budget under memory pressure: pins beyond it give way,
    lowest priority first, and come back when the budget grows again while their blocks are still
    cached; one unpinned meanwhile, or whose blocks were evicted, does not."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=40, block_size=BLOCK, pin_budget=0.5))  # 20 blocks
    system = tokens(48, 50)
    high = hf_paged_kv.pin(model, system, priority=5)  # 6 blocks
    low = hf_paged_kv.pin(model, tokens(48, 51), priority=1)  # 6 blocks
    gone = hf_paged_kv.pin(model, tokens(32, 52), priority=0)  # 4 blocks
    with pool.locked():
        pool.tune(pin_budget=0.15)  # 6 blocks: only the highest priority stays
    stats = pool.stats()
    assert stats["blocks_pinned"] == 6 and stats["pins_given_way"] == 2 and stats["pins_refused"] == 0
    hf_paged_kv.unpin(model, gone)  # unpinned while it had given way: gone for good
    with pool.locked():
        pool.tune(pin_budget=0.5)
    stats = pool.stats()
    assert sorted(p["id"] for p in stats["pins"]) == [high.id, low.id]
    assert stats["blocks_pinned"] == 12 and stats["pins_given_way"] == 0
    with pool.locked():
        pool.tune(pin_budget=0.15)  # the low pin gives way again ...
    pool.decref(pool.allocate(pool.num_available()))  # ... and its blocks are evicted meanwhile
    with pool.locked():
        pool.tune(pin_budget=0.5)
    stats = pool.stats()
    assert [p["id"] for p in stats["pins"]] == [high.id] and stats["pins_given_way"] == 0
    assert hf_paged_kv.cached_tokens(model, tokens(48, 51))["device"] == 0
    assert skip_of(model, torch.cat([system, tokens(5, 53)]))[0] == 48  # the pinned prefix stayed
    low = hf_paged_kv.pin(model, tokens(48, 51), priority=1)  # 6 blocks again
    small = hf_paged_kv.pin(model, tokens(16, 54), priority=0)  # 2 blocks
    with pool.locked():
        pool.tune(pin_budget=0.15)  # 6 blocks: the small pin and the low one give way
    with pool.locked():
        pool.tune(pin_budget=0.2)  # 8 blocks: the small pin would fit, but not before the low one
    assert pool.stats()["pins_given_way"] == 2 and pool.stats()["blocks_pinned"] == 6
    with pool.locked():
        pool.tune(pin_budget=0.5)
    assert pool.stats()["pins_given_way"] == 0 and pool.stats()["blocks_pinned"] == 14
    for pin in (high, low, small):
        hf_paged_kv.unpin(model, pin)
    assert_pool_clean(pool)


def test_a_pin_overlapping_a_displaced_one_keeps_the_budget(model):
    """Displacing a pin whose blocks the new pin also holds frees none of them: the budget is
    counted on the union, and a lower pin inside the new one stays."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=12, block_size=BLOCK, pin_budget=0.25))  # 3 blocks
    first, second = tokens(2 * BLOCK, 60), tokens(2 * BLOCK, 61)
    inside = hf_paged_kv.pin(model, first[:BLOCK], priority=0)  # block A
    pair = hf_paged_kv.pin(model, second, priority=0)  # blocks B, C
    hf_paged_kv.pin(model, first, priority=1)  # A and D: one more block than the budget has
    stats = pool.stats()
    assert stats["blocks_pinned"] <= stats["pin_budget_blocks"] == 3
    kept = {p["id"] for p in stats["pins"]}
    assert inside.id in kept and pair.id not in kept


def test_a_hot_pin_stays_when_its_longer_prefix_is_refused(model):
    import warnings

    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=8, block_size=BLOCK, pin_budget=0.125, hot_threshold=2.0))
    prompt = tokens(2 * BLOCK, 62)
    for seed in range(3):  # the first block gets hot: pinned (the budget is one block)
        skip_of(model, torch.cat([prompt[:BLOCK], tokens(1, 70 + seed)]))
    assert [p["blocks"] for p in pool.stats()["pins"]] == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the refusal of the longer hot prefix warns once
        for seed in range(4):  # both blocks hot: the longer prefix does not fit the budget
            skip_of(model, torch.cat([prompt, tokens(1, 80 + seed)]))
    assert [p["blocks"] for p in pool.stats()["pins"]] == [1] and pool.stats()["pins_refused"] > 0


def test_one_models_new_weights_leave_another_models_pins(model):
    """Two models share a pool: when one's weights change, its cached KV is forgotten, and only
    its own pins with it."""
    other = make_model("llama", seed=42)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, hot_threshold=None))
    hf_paged_kv.enable(other, pool=pool)
    kept = hf_paged_kv.pin(other, tokens(2 * BLOCK, 63))
    mine = hf_paged_kv.pin(model, tokens(2 * BLOCK, 64))
    skip_of(model, tokens(BLOCK + 2, 65))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.01)  # a fine-tune step, in place
    skip_of(model, tokens(BLOCK + 2, 66))  # the next request sees the new weights
    assert [p["id"] for p in pool.stats()["pins"]] == [kept.id] and mine.id != kept.id
    hf_paged_kv.disable(other)


def test_a_pin_that_gave_way_does_not_come_back_after_its_tenant_is_cleared(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, hot_threshold=None))
    prompt = tokens(2 * BLOCK, 67)
    hf_paged_kv.pin(model, prompt, tenant="t", priority=5)
    with pool.locked():
        pool.tune(pin_budget=0.0)  # the pin gives way, to come back when the budget grows
    pool.clear_tenant("t")
    skip_of(model, torch.cat([prompt, tokens(1, 68)]), tenant="t")  # the tenant computes the prefix again
    with pool.locked():
        pool.tune(pin_budget=0.25)
    assert pool.stats()["pins"] == []


def test_a_tenant_pins_its_prefix_over_a_published_one(model):
    """The pinning forward inherits what is cached (the public system prompt, the tenant's own
    continuation): it pins the blocks later requests find, where it once recomputed duplicates
    that no lookup reaches (or, refusing unindexed blocks, raised)."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=BLOCK))
    system, own = tokens(2 * BLOCK, 60), tokens(2 * BLOCK, 61)
    hf_paged_kv.publish(model, system)
    prompt = torch.cat([system, own, tokens(1, 62)])[None]
    with PagedCache(tenant="acme") as cache:
        greedy(model, cache, prompt, torch.ones_like(prompt), new_tokens=1)
    pin = hf_paged_kv.pin(model, torch.cat([system, own]), tenant="acme")
    with PagedCache(tenant="acme") as cache:
        greedy(model, cache, prompt, torch.ones_like(prompt), new_tokens=1)
        assert cache.inherited == [4 * BLOCK] and cache.block_tables()[0][:4] == pin.blocks
    hf_paged_kv.unpin(model, pin)
    assert_pool_clean(pool)


def plain_forward(model, prompt):
    """A forward outside generate: every position computed, its full blocks indexed."""
    with PagedCache() as cache, torch.no_grad():
        model(input_ids=prompt[None], past_key_values=cache)


def test_a_pin_whose_digests_name_blocks_of_another_chain_does_not_come_back(model):
    """A pin gives way; its first block expires and the prefix's first block is computed again
    (the digest's name moves to the new copy), while its second block, still fresh, continues the
    expired one. Restored on those two, it held a block whose parent was idle and counted as
    evictable but could never be evicted: audit failed, and allocating every available block failed."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=BLOCK, pin_budget=0.5, ttl=100))
    clock = manual_clock(pool)
    system = tokens(16, 1)
    plain_forward(model, system[:8])  # the first block, expiring at 100
    clock[0] = 50.0
    assert skip_of(model, torch.cat([system, tokens(3, 2)]))[0] == 8  # the second block, expiring at 150
    pin = hf_paged_kv.pin(model, system)
    with pool.locked():
        pool.tune(pin_budget=0.0)
    clock[0] = 110.0
    plain_forward(model, system[:8])  # a fresh copy of the first block takes its name
    with pool.locked():
        pool.tune(pin_budget=0.5)
    stats = pool.stats()
    assert stats["pins"] == [] and stats["pins_refused"] == 1 and stats["pins_given_way"] == 0
    pool.audit()
    pool.decref(pool.allocate(pool.num_available()))
    hf_paged_kv.unpin(model, pin)  # lost already: nothing happens
    assert_pool_clean(pool)


def test_unpinning_another_pools_pin_changes_nothing(model):
    """Pin ids restart with each pool: a pin of the model's earlier pool (resized by disable and
    enable) unpinned another pin of the new pool and freed blocks a conversation held."""
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=BLOCK))
    old = hf_paged_kv.pin(model, tokens(16, 1))
    hf_paged_kv.disable(model)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=BLOCK))
    new = hf_paged_kv.pin(model, tokens(16, 2))
    assert new.id == old.id
    hf_paged_kv.unpin(model, old)
    assert [p["id"] for p in pool.stats()["pins"]] == [new.id] and pool.stats()["blocks_pinned"] == 2
    hf_paged_kv.unpin(model, new)
    assert_pool_clean(pool)


def test_turn_pins_hold_only_blocks_the_index_offers(model):
    """Blocks after a hole in a turn's mask are never shared: pinned, they only held memory."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=BLOCK, pin_budget=0.5))
    ids = tokens(40, 1)[None]
    mask = torch.ones_like(ids)
    mask[0, 10] = 0
    with PagedCache(pin_turns=1) as cache:
        out = greedy(model, cache, ids, mask, new_tokens=2)
        turn2 = torch.cat([out, tokens(3, 2)[None]], dim=1)
        mask2 = torch.cat([mask, torch.ones(1, turn2.shape[1] - ids.shape[1], dtype=torch.long)], 1)
        got = greedy(model, cache, turn2, mask2, new_tokens=2)
    assert [(p["reason"], p["blocks"]) for p in pool.stats()["pins"]] == [("turns", 1)]  # the block before the hole
    hf_paged_kv.disable(model)
    dynamic = DynamicCache()
    out = greedy(model, dynamic, ids, mask, new_tokens=2)
    torch.testing.assert_close(got, greedy(model, dynamic, turn2, mask2, new_tokens=2), rtol=0, atol=0)


def test_a_pin_that_gave_way_comes_back_before_lower_priorities_pinned_meanwhile(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=40, block_size=BLOCK, pin_budget=0.25))  # 10 blocks
    high = hf_paged_kv.pin(model, tokens(64, 1), priority=5)  # 8 blocks
    with pool.locked():
        pool.tune(pin_budget=0.1)  # 4 blocks: the high pin gives way
    low = hf_paged_kv.pin(model, tokens(32, 2), priority=0)  # 4 blocks: fits the smaller budget
    with pool.locked():
        pool.tune(pin_budget=0.25)
    assert [p["id"] for p in pool.stats()["pins"]] == [high.id]  # the low one is displaced, as by a new pin
    hf_paged_kv.unpin(model, high)
    hf_paged_kv.unpin(model, low)
    assert_pool_clean(pool)


@pytest.mark.parametrize("which", ["pool_ttl", "pin_ttl"])
def test_the_blocks_of_a_pin_that_ended_serve_the_next_allocation(model, which):
    """An ended pin was let go only by stats(), a new pin or an eviction, and the allocation's
    check of what eviction could free came first: it failed although the pin had ended."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=16, block_size=BLOCK, pin_budget=1.0, hot_threshold=None,
                                                 ttl=60 if which == "pool_ttl" else None))
    clock = manual_clock(pool)
    hf_paged_kv.pin(model, tokens(80, 1), ttl=None if which == "pool_ttl" else 30)  # 10 blocks
    clock[0] = 100.0
    prompt = tokens(90, 2)  # 12 blocks
    skipped, out = skip_of(model, prompt)
    expected = greedy(model, DynamicCache(), prompt[None], torch.ones(1, 90, dtype=torch.long), new_tokens=4)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert_pool_clean(pool)


def test_tune_moves_the_settings_the_controller_moves_and_refuses_bad_values(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=40, block_size=BLOCK, pin_budget=0.25, half_life=60.0))
    hf_paged_kv.pin(model, tokens(48, 10))  # 6 blocks
    pool.tune(pin_budget=0.1)  # 4 blocks: the pin gives way
    assert pool.stats()["blocks_pinned"] == 0 and pool.stats()["pins_given_way"] == 1
    pool.tune(pin_budget=0.25, half_life=15.0, hot_threshold=3.0)
    assert pool.stats()["blocks_pinned"] == 6
    assert pool.tuning() == {"pin_budget": 0.25, "hot_threshold": 3.0, "half_life": 15.0}
    assert pool.options["half_life"] == 60.0  # what it was built with, where the controller returns
    for settings, message in ((dict(pin_budget=1.5), "pin_budget is a fraction"),
                              (dict(half_life=0.0), "half_life must be > 0"),
                              (dict(hot_threshold=-1.0), "hot_threshold")):
        with pytest.raises(ValueError, match=message):
            pool.tune(**settings)
    assert pool.tuning() == {"pin_budget": 0.25, "hot_threshold": 3.0, "half_life": 15.0}
