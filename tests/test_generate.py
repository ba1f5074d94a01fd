"""PagedCache gives exactly the tokens DynamicCache gives (fp32, greedy), on every supported architecture."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from conftest import ARCHITECTURES, PAD, ForwardWidths, assert_pool_clean, fragment, greedy, make_model, random_batch
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, PagedKVError


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_matches_dynamic_cache(arch, batch):
    model = make_model(arch, seed=batch)
    ids, mask = random_batch(batch, 40, seed=batch)
    expected = greedy(model, DynamicCache(), ids, mask)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=256, block_size=16))
    with PagedCache() as cache:
        got = greedy(model, cache, ids, mask)
        assert cache.pool is pool
        # pad positions are never stored: each row holds its real prompt tokens plus the fed-back tokens
        assert cache.row_lengths() == (mask.sum(1) + 12 - 1).tolist()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_pool_clean(pool)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_block_sizes_and_prompts_spanning_many_blocks(block_size):
    model = make_model("llama", seed=1)
    ids, mask = random_batch(4, 150, seed=7)
    expected = greedy(model, DynamicCache(), ids, mask, new_tokens=20)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=2048 // block_size + 16, block_size=block_size))
    with PagedCache() as cache:
        got = greedy(model, cache, ids, mask, new_tokens=20)
        tables = cache.block_tables()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert max(len(t) for t in tables) >= 169 // block_size
    assert_pool_clean(pool)


@pytest.mark.parametrize("rows", [3, 1])  # one row: attended alone, gathered from its window's first block
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_fragmented_pool_gives_same_tokens(arch, rows):
    """Blocks scattered over the pool (no sequence gets a contiguous run) must not change the answer."""
    model = make_model(arch, seed=2)
    ids, mask = random_batch(rows, 70, seed=3)
    expected = greedy(model, DynamicCache(), ids, mask, new_tokens=16)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=128, block_size=8))
    held = fragment(pool)
    with PagedCache() as cache:
        got = greedy(model, cache, ids, mask, new_tokens=16)
        tables = cache.block_tables()
    assert all(b - a != 1 for t in tables for a, b in zip(t, t[1:]))  # no two consecutive blocks
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    pool.decref(held)
    assert_pool_clean(pool)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_uniform_batch_rows_are_spread_evenly_and_read_as_one_view(arch):
    """Rows of one length (no padding) get runs at a fixed stride, so decoding reads them all
    through one strided view of the pool; the tokens are DynamicCache's."""
    model = make_model(arch, seed=5)
    ids = torch.randint(3, 96, (4, 37), generator=torch.Generator().manual_seed(5))
    expected = greedy(model, DynamicCache(), ids, None, new_tokens=30)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=160, block_size=8))
    with PagedCache(reuse=False) as cache:
        got = greedy(model, cache, ids, None, new_tokens=30)
        starts = [t[0] for t in cache.block_tables()]
        tables = cache.block_tables()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len({b - a for a, b in zip(starts, starts[1:])}) == 1  # one stride
    assert all(t == list(range(t[0], t[0] + len(t))) for t in tables)
    assert_pool_clean(pool)


def test_contiguous_rows_when_the_pool_allows():
    """A batch on an empty pool gets one run of consecutive blocks per row, even while the rows
    grow in lockstep during decoding (what lets the torch backend read them without a copy)."""
    model = make_model("llama", seed=2)
    ids, mask = random_batch(4, 70, seed=3)
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=256, block_size=8))
    with PagedCache(reuse=False) as cache:
        greedy(model, cache, ids, mask, new_tokens=40)
        tables = cache.block_tables()
    assert all(t == list(range(t[0], t[0] + len(t))) for t in tables), tables


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_multi_turn_chat_prefills_only_new_tokens(arch):
    model = make_model(arch, seed=3)
    turn1, _ = random_batch(1, 30, seed=11)
    extras = [random_batch(1, n, seed=20 + n)[0] for n in (9, 17)]

    def converse(cache):
        ids, outputs = turn1, []
        for extra in [None, *extras]:
            if extra is not None:
                ids = torch.cat([ids, extra], dim=1)
            ids = greedy(model, cache, ids, torch.ones_like(ids), new_tokens=8)
            outputs.append(ids)
        return outputs

    expected = converse(DynamicCache())
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=16))
    cache = PagedCache()
    widths = ForwardWidths(model)
    got = converse(cache)
    widths.remove()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    # prefill lengths: the first prompt, then only each turn's new tokens (+ the last reply token)
    prefills = [n for n in widths.widths if n > 1]
    assert prefills == [30, 9 + 1, 17 + 1]
    cache.release()
    assert_pool_clean(pool)


def test_batched_multi_turn_with_padding():
    model = make_model("qwen2", seed=4)
    ids, mask = random_batch(3, 25, seed=5)
    follow = torch.randint(3, 96, (3, 6), generator=torch.Generator().manual_seed(1))

    def two_turns(cache):
        first = greedy(model, cache, ids, mask, new_tokens=6)
        second_ids = torch.cat([first, follow], dim=1)
        second_mask = torch.cat([mask, torch.ones(3, 12, dtype=mask.dtype)], dim=1)
        return greedy(model, cache, second_ids, second_mask, new_tokens=6)

    expected = two_turns(DynamicCache())
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    with PagedCache() as cache:
        torch.testing.assert_close(two_turns(cache), expected, rtol=0, atol=0)


def test_a_turn_that_does_not_continue_the_cached_conversation_is_warned_about_or_refused():
    """transformers feeds only the ids past the cache's length: a second turn built on another
    history (or an interrupted call's leftover token) attends to the held tokens' K/V, as with
    DynamicCache: warned about; the new tokens alone failed in a reshape: refused, the cache
    unchanged. Positions the call's mask hides are not compared, and the right turn afterwards
    equals DynamicCache."""
    model = make_model("qwen2", seed=4)
    ids, mask = random_batch(3, 25, seed=5)
    follow = torch.randint(3, 96, (3, 6), generator=torch.Generator().manual_seed(1))
    second_mask = torch.cat([mask, torch.ones(3, 12, dtype=mask.dtype)], dim=1)
    second_mask[0, 2:5] = 0  # row 0 (unpadded) hides three tokens it stored, given as pad ids

    def second_turn_ids(first):
        return torch.where(second_mask.bool(), torch.cat([first, follow], dim=1), PAD)

    dynamic = DynamicCache()
    expected = greedy(model, dynamic, second_turn_ids(greedy(model, dynamic, ids, mask, new_tokens=6)), second_mask,
                      new_tokens=6)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=96, block_size=4))
    with PagedCache() as cache:
        second_ids = second_turn_ids(greedy(model, cache, ids, mask, new_tokens=6))
        lengths = cache.row_lengths()
        other = second_ids.clone()
        other[1, 27] = (other[1, 27] + 1) % 96  # one of the tokens the first turn generated, changed
        with pytest.warns(UserWarning, match="input_ids row 1 has token .* at position 27, where this PagedCache holds"):
            greedy(model, copy.deepcopy(cache), other, second_mask, new_tokens=6)
        with pytest.raises(PagedKVError, match="fewer than the 30 this PagedCache holds"):
            greedy(model, cache, follow, torch.ones_like(follow), new_tokens=6)  # the new tokens alone
        assert cache.row_lengths() == lengths
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a pad id where the mask hides a stored token is not a difference
            got = greedy(model, cache, second_ids, second_mask, new_tokens=6)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_pool_clean(pool)


def test_sampling_matches_with_the_same_seed(llama):
    ids, mask = random_batch(4, 30, seed=6)
    kwargs = dict(do_sample=True, temperature=0.9, top_k=20, max_new_tokens=16)
    torch.manual_seed(123)
    expected = llama.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(), **kwargs)
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64))
    torch.manual_seed(123)
    with PagedCache() as cache:
        got = llama.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kwargs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_num_return_sequences_share_the_prompt_blocks(llama):
    ids, mask = random_batch(2, 40, seed=8)
    kwargs = dict(do_sample=True, num_return_sequences=4, max_new_tokens=10, min_new_tokens=10)
    torch.manual_seed(5)
    expected = llama.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(), **kwargs)
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=128, block_size=8))
    torch.manual_seed(5)
    with PagedCache() as cache:
        got = llama.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kwargs)
        tables = cache.block_tables()
        lengths = cache.row_lengths()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # the 4 samples of one prompt share its full blocks; only the blocks they wrote on their own differ
    for prompt in range(2):
        rows = tables[prompt * 4 : prompt * 4 + 4]
        full = int(mask[prompt].sum()) // 8
        assert all(r[:full] == rows[0][:full] for r in rows)
        assert len({r[-1] for r in rows}) == 4  # divergent tails were copied on write
    # far fewer blocks than 8 independent copies of the prompts would take
    independent = sum(-(-n // 8) for n in lengths)
    assert pool.stats()["blocks_used_high_water"] < independent
    assert_pool_clean(pool)


def test_beam_search_matches_dynamic_cache(llama):
    ids, mask = random_batch(2, 30, seed=9)
    kwargs = dict(num_beams=3, max_new_tokens=10, do_sample=False, early_stopping=True)
    expected = llama.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(), **kwargs)
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=128, block_size=4))
    with PagedCache() as cache:
        got = llama.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kwargs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_pool_clean(pool)


def test_assisted_decoding_crops_correctly():
    model, assistant = make_model("llama", seed=10), make_model("llama", seed=11)
    ids, _ = random_batch(1, 30, seed=12)
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=20, do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(), **kwargs)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    with PagedCache() as cache:
        got = model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=cache, assistant_model=assistant, **kwargs
        )
        assert cache.get_seq_length() == cache.row_lengths()[0] == got.shape[1] - 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_pool_clean(pool)


def test_inputs_embeds_generation(llama):
    ids, mask = random_batch(2, 20, seed=13)
    embeds = llama.get_input_embeddings()(ids)
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=8, do_sample=False)
    expected = llama.generate(past_key_values=DynamicCache(), **kwargs)
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32))
    with PagedCache() as cache:
        torch.testing.assert_close(llama.generate(past_key_values=cache, **kwargs), expected, rtol=0, atol=0)


def test_plain_forward_logits_match(llama):
    """Direct model calls (no generate) with a PagedCache: prefill then one step."""
    ids, mask = random_batch(3, 17, seed=14)
    nxt = torch.randint(3, 96, (3, 1))
    full_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)

    def run(cache):
        position = (mask.cumsum(1) - 1).clamp_min(0)
        first = llama(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache).logits
        second = llama(
            input_ids=nxt, attention_mask=full_mask, position_ids=position[:, -1:] + 1, past_key_values=cache
        ).logits
        return first, second

    expected = run(DynamicCache())
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32, block_size=4))
    with PagedCache() as cache:
        got = run(cache)
    real = mask.bool()
    torch.testing.assert_close(got[0][real], expected[0][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)


def test_enabled_model_still_works_with_dynamic_cache(llama):
    ids, mask = random_batch(3, 20, seed=15)
    before = greedy(llama, DynamicCache(), ids, mask)
    hf_paged_kv.enable(llama)
    torch.testing.assert_close(greedy(llama, DynamicCache(), ids, mask), before, rtol=0, atol=0)
    torch.testing.assert_close(greedy(llama, None, ids, mask), before, rtol=0, atol=0)


def test_garbage_collected_cache_frees_its_blocks(llama):
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32))
    ids, mask = random_batch(2, 20)
    greedy(llama, PagedCache(), ids, mask)
    gc.collect()
    assert_pool_clean(pool)
    assert pool.stats()["blocks_used_high_water"] > 0
