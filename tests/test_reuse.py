"""Cross-request reuse: inherited prefixes give exactly the tokens computed without reuse."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import PAD, VOCAB, ForwardWidths, assert_pool_clean, greedy, make_model, manual_clock
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, PoolExhaustedError

BLOCK = 8


def tokens(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def left_padded(rows):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return ids, mask


@pytest.fixture
def model():
    model = make_model("llama", seed=21)
    yield model
    hf_paged_kv.disable(model)


def run(model, rows, reuse=True, tenant="default", new_tokens=12):
    """Generate for a left-padded batch of `rows`; returns the output and how many leading
    prompt columns the first forward skipped (every row had them cached or padded)."""
    ids, mask = left_padded(rows)
    widths = ForwardWidths(model)
    with PagedCache(reuse=reuse, tenant=tenant) as cache:
        out = greedy(model, cache, ids, mask, new_tokens=new_tokens)
    widths.remove()
    return out, ids.shape[1] - widths.widths[0]


def on_device(model, prompt, tenant="default"):
    return hf_paged_kv.cached_tokens(model, prompt, tenant=tenant)["device"]


def test_shared_prefix_is_inherited_and_gives_the_same_tokens(model):
    system = tokens(40, 1)
    first, second = torch.cat([system, tokens(5, 2)]), torch.cat([system, tokens(9, 3)])
    expected = greedy(model, DynamicCache(), *left_padded([second]))
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=BLOCK))
    run(model, [first])
    got, skip = run(model, [second])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert skip == 40  # the 5 full blocks of the system prompt were not recomputed
    stats = pool.stats()
    assert stats["hit_tokens_prefix"] == 40 and stats["lookups"] == 2
    assert stats["hit_rate"] == pytest.approx(40 / (45 + 49))
    no_reuse, skip = run(model, [second], reuse=False)
    torch.testing.assert_close(no_reuse, expected, rtol=0, atol=0)
    assert skip == 0
    assert_pool_clean(pool)


def test_batch_rows_match_different_lengths(model):
    long_prefix, short_prefix = tokens(48, 4), tokens(16, 5)
    rows = [torch.cat([long_prefix, tokens(6, 6)]), torch.cat([short_prefix, tokens(20, 7)]), tokens(11, 8)]
    expected = greedy(model, DynamicCache(), *left_padded(rows))
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=128, block_size=BLOCK))
    run(model, [torch.cat([long_prefix, tokens(3, 9)]), torch.cat([short_prefix, tokens(30, 10)])])
    got, skip = run(model, rows)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert pool.stats()["hit_tokens_prefix"] == 48 + 16
    assert skip == 54 - 20  # batch width minus the most any row computes (the short-prefix row: 20)
    assert_pool_clean(pool)


def test_stateless_multi_turn_reuses_the_previous_turn(model):
    """A server that resends the whole history each turn with a fresh cache."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=128, block_size=BLOCK))
    history = tokens(30, 11)
    skipped = []
    for turn in range(4):
        ids = history[None]
        expected = greedy(model, DynamicCache(), ids, torch.ones_like(ids), new_tokens=6)
        got, skip = run(model, [history], new_tokens=6)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        skipped.append(skip)
        history = torch.cat([got[0], tokens(7, 12 + turn)])
    assert skipped[0] == 0 and all(s >= 24 for s in skipped[1:])
    assert_pool_clean(pool)


def test_identical_blocks_in_one_batch_are_stored_once(model):
    system = tokens(64, 13)
    rows = [torch.cat([system, tokens(4 + i, 20 + i)]) for i in range(4)]
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=128, block_size=BLOCK))
    ids, mask = left_padded(rows)
    with PagedCache() as cache:
        got = greedy(model, cache, ids, mask)
        tables = cache.block_tables()
        assert all(t[:8] == tables[0][:8] for t in tables)  # the system prompt's 8 blocks, shared
        assert pool.stats()["blocks_used"] < sum(len(t) for t in tables) - 3 * 8 + 1
    torch.testing.assert_close(got, greedy(model, DynamicCache(), ids, mask), rtol=0, atol=0)
    assert_pool_clean(pool)


def test_tenants_never_share_unless_published(model):
    prompt = tokens(40, 14)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=BLOCK))
    run(model, [prompt], tenant="acme")
    _, skip = run(model, [prompt], tenant="globex")  # identical prompt, other tenant: no hit
    assert skip == 0 and pool.stats()["hit_tokens_prefix"] == 0
    _, skip = run(model, [prompt], tenant="acme")
    assert skip == 32
    assert hf_paged_kv.publish(model, prompt[:24]) == 24
    expected = greedy(model, DynamicCache(), prompt[None], torch.ones(1, 40, dtype=torch.long))
    got, skip = run(model, [prompt], tenant="initech")
    assert skip == 24  # only the published part
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="tenant must be"):
        PagedCache(tenant="__public__")
    assert_pool_clean(pool)


def test_clear_tenant_forgets_its_prefixes(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=BLOCK))
    run(model, [tokens(40, 15)], tenant="acme")
    run(model, [tokens(40, 16)], tenant="globex")
    cached = pool.stats()["blocks_cached"]
    freed = pool.clear_tenant("acme")
    assert freed > 0 and pool.stats()["blocks_cached"] == cached - freed
    assert on_device(model, tokens(40, 15), "acme") == 0 and on_device(model, tokens(40, 16), "globex") == 40
    _, skip = run(model, [tokens(40, 15)], tenant="acme")
    assert skip == 0
    assert_pool_clean(pool)


def test_clear_tenant_under_a_live_chat_leaves_every_cached_block_evictable(model):
    """clear_tenant unindexes the blocks of a chat still alive, and its next turn indexes blocks
    that follow one of them. When that block's id is freed and indexed again, evicting the chat's
    blocks must not take from it a child it never counted: it would never be a leaf again,
    never evicted yet counted as available."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=12, block_size=BLOCK))
    chat = PagedCache(tenant="acme")
    first = greedy(model, chat, *left_padded([tokens(20, 80)]), new_tokens=4)
    pool.clear_tenant("acme")
    second = left_padded([torch.cat([first[0], tokens(12, 81)])])
    expected = greedy(model, DynamicCache(), *second, new_tokens=4)
    torch.testing.assert_close(greedy(model, chat, *second, new_tokens=4), expected, rtol=0, atol=0)
    forgotten = chat.block_tables()[0][1]  # the block before the first one this turn indexed
    chat.release()
    held = pool.allocate(pool.num_free())
    spare = max(set(held) - {forgotten})
    pool.decref([forgotten, spare])
    with PagedCache(priority=8) as cache:  # valued above the chat's blocks: they are evicted first
        greedy(model, cache, *left_padded([tokens(9, 82)]), new_tokens=2)
        assert cache.block_tables()[0][0] == forgotten  # its full block is indexed under that id
    pool.decref([b for b in held if b not in (forgotten, spare)])
    pool.decref(pool.allocate(pool.num_free() + 2))  # evicts the chat's two blocks, leaf first
    pool.decref(pool.allocate(pool.num_available()))  # and then the other one
    assert pool.stats()["blocks_cached"] == 0
    assert_pool_clean(pool)


def test_a_row_never_switches_to_a_block_whose_expired_parent_it_does_not_hold(model):
    """With a TTL, a prefix's first block can expire while the next one has not: a row that
    computed both again indexes its own first block, and must not switch its second one to the
    unexpired block, whose idle, expired parent could then not be evicted while counted as
    available."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=12, block_size=BLOCK, ttl=10.0))
    clock = manual_clock(pool)
    with PagedCache() as chat:
        first = greedy(model, chat, *left_padded([tokens(9, 83)]), new_tokens=4)  # t=0: block 0 indexed
        clock[0] = 5.0
        second = greedy(model, chat, *left_padded([torch.cat([first[0], tokens(6, 84)])]), new_tokens=2)
    clock[0] = 12.0  # block 0 expired, block 1 not
    prompt = left_padded([second[0, :20]])
    expected = greedy(model, DynamicCache(), *prompt, new_tokens=2)
    with PagedCache() as cache:
        torch.testing.assert_close(greedy(model, cache, *prompt, new_tokens=2), expected, rtol=0, atol=0)
        pool.decref(pool.allocate(pool.num_available()))  # every block counted available is
        pool.audit()
    assert_pool_clean(pool)


def test_ttl_expiry(model):
    pool = KVPool(num_blocks=64, block_size=BLOCK, ttl=10.0)
    hf_paged_kv.enable(model, pool=pool)
    clock = manual_clock(pool)
    prompt = tokens(40, 17)
    run(model, [prompt])
    clock[0] = 5.0
    assert run(model, [prompt])[1] == 32
    clock[0] = 11.0
    assert run(model, [prompt])[1] == 0  # expired entries are never reused ...
    assert run(model, [prompt])[1] == 32  # ... but the prefix computed again is cached again
    taken = pool.allocate(pool.num_free() + 1)  # pressure: expired blocks go first, and are counted as such
    assert pool.stats()["expirations"] > 0
    pool.decref(taken)
    assert_pool_clean(pool)


def test_eviction_takes_cold_leaves_first(model):
    pool = KVPool(num_blocks=24, block_size=BLOCK, half_life=10.0)
    hf_paged_kv.enable(model, pool=pool)
    clock = manual_clock(pool)
    hot, cold = tokens(41, 18), tokens(40, 19)  # 41: all 5 full blocks of the hot prompt are reusable
    run(model, [hot], new_tokens=1)
    run(model, [cold], new_tokens=1)
    for _ in range(3):  # the hot prefix is used again and again
        clock[0] += 1
        assert run(model, [hot], new_tokens=1)[1] == 40
    clock[0] += 1
    taken = pool.allocate(pool.num_free() + 3)  # needs 3 evictions
    assert pool.stats()["evictions"] == 3
    # the cold prefix lost its 3 deepest blocks, leaf first; every hot block is still cached
    assert on_device(model, cold) == 16 and on_device(model, hot) == 40
    pool.decref(taken)
    assert run(model, [cold], new_tokens=1)[1] == 16
    assert run(model, [hot], new_tokens=1)[1] == 40
    assert_pool_clean(pool)


def test_pool_exhaustion_with_reuse_leaves_no_trace(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=8, block_size=BLOCK))
    system = tokens(32, 22)
    run(model, [torch.cat([system, tokens(3, 23)])], new_tokens=1)
    before = pool.audit()
    with pytest.raises(PoolExhaustedError):
        run(model, [torch.cat([system, tokens(70, 24)])])
    assert pool.audit() == before  # inherited blocks were given back
    assert_pool_clean(pool)


def test_failed_forward_is_undone(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=BLOCK))
    prompt = tokens(30, 25)
    ids = prompt[None]
    expected = greedy(model, DynamicCache(), ids, torch.ones_like(ids), new_tokens=6)
    calls = [0]

    def fail_once(module, args):
        calls[0] += 1
        if calls[0] == 3:  # the decode step after prefill + 1 token, in the second layer
            raise RuntimeError("injected failure")

    handle = model.model.layers[1].register_forward_pre_hook(fail_once)
    cache = PagedCache()
    with pytest.raises(RuntimeError, match="injected"):
        greedy(model, cache, ids, torch.ones_like(ids), new_tokens=6)
    handle.remove()
    assert cache.row_lengths() == [31] and cache.get_seq_length() == 31  # the failed step left no trace
    cache.release()
    got, _ = run(model, [prompt], new_tokens=6)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_pool_clean(pool)


def test_concurrent_generate_calls_on_one_pool(model):
    system = tokens(32, 26)
    prompts = [torch.cat([system, tokens(5 + i, 30 + i)]) for i in range(6)]
    expected = [greedy(model, DynamicCache(), p[None], torch.ones(1, len(p), dtype=torch.long)) for p in prompts]
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=96, block_size=BLOCK))
    results, errors = {}, []

    def worker(i):
        try:
            for _ in range(2):
                results[i] = run(model, [prompts[i]])[0]
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, e in enumerate(expected):
        torch.testing.assert_close(results[i], e, rtol=0, atol=0)
    assert pool.stats()["hit_tokens_prefix"] > 0
    assert_pool_clean(pool)


def test_pipeline_reuses_prefixes_across_calls():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0", eos_token="w2")
    model = make_model("llama", seed=31)
    system = " ".join(f"w{i}" for i in tokens(40, 32).tolist())
    questions = [system + " " + " ".join(f"w{i}" for i in tokens(6, 40 + q).tolist()) for q in range(3)]
    kwargs = dict(max_new_tokens=6, do_sample=False, return_full_text=False)
    import transformers

    plain = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = [plain(q, **kwargs)[0]["generated_text"] for q in questions]
    paged = hf_paged_kv.pipeline("text-generation", model=model, tokenizer=tokenizer)
    got = [paged(q, **kwargs)[0]["generated_text"] for q in questions]
    assert got == expected
    pool = hf_paged_kv.pool_of(model)
    assert pool.stats()["hit_tokens_prefix"] == 2 * (40 // 16 * 16)  # calls 2 and 3 inherit the whole blocks
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


def test_priority_raises_a_prefix_value_in_eviction(model):
    pool = KVPool(num_blocks=16, block_size=BLOCK)
    hf_paged_kv.enable(model, pool=pool)
    clock = manual_clock(pool)
    important, ordinary = tokens(40, 50), tokens(40, 51)
    with PagedCache(priority=2) as cache:  # older, so by recency alone it would go first
        greedy(model, cache, important[None], torch.ones(1, 40, dtype=torch.long), new_tokens=1)
    clock[0] = 100.0
    run(model, [ordinary], new_tokens=1)
    pool.allocate(pool.num_free() + 5)  # five evictions
    assert on_device(model, important) == 40 and on_device(model, ordinary) == 0


def test_cold_batch_computes_a_shared_prefix_once(model):
    """A fresh batch whose rows share a system prompt no request has computed yet: it is
    computed once, in a forward of its own, and every row inherits it."""
    system = tokens(64, 60)
    rows = [torch.cat([system, tokens(3 + 2 * i, 61 + i)]) for i in range(5)] + [tokens(20, 70)]
    ids, mask = left_padded(rows)
    expected = greedy(model, DynamicCache(), ids, mask)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=128, block_size=BLOCK))
    widths = ForwardWidths(model)
    with PagedCache() as cache:
        got = greedy(model, cache, ids, mask)
        inherited = cache.inherited
    widths.remove()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert widths.widths[0] == 64  # the system prompt's 8 blocks, once
    assert inherited == [64] * 5 + [0]
    assert widths.widths[1] == 20  # then only the columns some row still computes: the last row's 20 tokens
    assert_pool_clean(pool)


# ------------------------------------------- K/V that another forward of the same tokens would not compute
def length_scaled_rope_model(kind: str):
    """A tiny model whose RoPE frequencies follow the forward's length past 32 positions:
    Llama with "dynamic" NTK scaling, or Phi-3's "longrope" (Phi-3-mini-128k, Phi-3.5-mini)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.3, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if kind == "dynamic":
        config = LlamaConfig(max_position_embeddings=32, **common,
                             rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
        model = LlamaForCausalLM(config)
    else:
        config = Phi3Config(max_position_embeddings=128, original_max_position_embeddings=32, **common,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                             "original_max_position_embeddings": 32, "short_factor": [1.0] * 8,
                                             "long_factor": [1.0, 2, 4, 8, 16, 32, 64, 64]})
        model = Phi3ForCausalLM(config)
    model.eval().generation_config.pad_token_id = PAD
    return model


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_rope_scaled_by_the_forward_length_is_never_shared(kind):
    """Past the original context, transformers picks these models' RoPE frequencies by the
    forward's largest position: a prefix computed in a long forward, or in the short forward that
    computes a batch's shared prefix first, is not the prefix a forward of another length computes.
    Such forwards share nothing; within the original context reuse works as for any model."""
    model = length_scaled_rope_model(kind)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, VOCAB, (1, 16), generator=gen)
    long_batch = torch.cat([prefix.repeat(2, 1), torch.randint(3, VOCAB, (2, 30), generator=gen)], 1)
    short = torch.cat([prefix, torch.randint(3, VOCAB, (1, 4), generator=gen)], 1)
    expected = {name: greedy(model, DynamicCache(), ids, torch.ones_like(ids), new_tokens=6)
                for name, ids in (("long", long_batch), ("short", short))}
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=8))
    assert hf_paged_kv.integration.hooks.state_of(model).rope_limit == 32
    with PagedCache() as cache:  # a cold batch sharing a prefix, past the original context
        got = greedy(model, cache, long_batch, torch.ones_like(long_batch), new_tokens=6)
        assert cache.inherited == [0, 0]
    torch.testing.assert_close(got, expected["long"], rtol=0, atol=0)
    with PagedCache() as cache:  # the long forward's blocks were not offered to a short one
        got = greedy(model, cache, short, torch.ones_like(short), new_tokens=6)
        assert cache.inherited == [0]
    torch.testing.assert_close(got, expected["short"], rtol=0, atol=0)
    with PagedCache() as cache:  # within the original context, the short prompt's own blocks are reused
        got = greedy(model, cache, short, torch.ones_like(short), new_tokens=6)
        assert cache.inherited == [16]
    torch.testing.assert_close(got, expected["short"], rtol=0, atol=0)
    with pytest.raises(hf_paged_kv.PagedKVError, match="only 0 of the prefix's 5 full blocks can be shared"):
        hf_paged_kv.pin(model, long_batch[0])  # 46 tokens: past position 32
    assert hf_paged_kv.publish(model, short[0]) == 16  # within it, as for any model
    hf_paged_kv.disable(model)
    assert_pool_clean(pool)


def test_a_forward_in_train_mode_shares_nothing():
    """With dropout on (OPT's hidden dropout; attention dropout stays refused), K/V are random:
    indexed, they changed later eval-mode requests' tokens."""
    from tiny_models import build

    model = build("opt")
    assert model.config.dropout > 0
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    expected = greedy(model.eval(), DynamicCache(), ids, torch.ones_like(ids), new_tokens=6)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=8))
    model.train()
    with PagedCache() as cache:
        greedy(model, cache, ids, torch.ones_like(ids), new_tokens=6)
    model.eval()
    with PagedCache() as cache:
        got = greedy(model, cache, ids, torch.ones_like(ids), new_tokens=6)
        assert cache.inherited == [0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    hf_paged_kv.disable(model)
    assert_pool_clean(pool)


def test_a_batch_sharing_a_published_prefix_and_an_uncached_one_matches_dynamic_cache(model):
    """The shared prefixes of a cold batch are computed first; one found whole (published) adds
    no ids to that forward, which then got float ids and failed."""
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=2))
    published, fresh = [5, 6, 7, 8], [20, 21, 22, 23]
    hf_paged_kv.publish(model, published)
    ids = torch.tensor([published + [9, 10], published + [11, 12], fresh + [13, 14], fresh + [15, 16]])
    expected = greedy(model, DynamicCache(), ids, torch.ones_like(ids), new_tokens=3)
    with PagedCache() as cache:
        assert torch.equal(greedy(model, cache, ids, torch.ones_like(ids), new_tokens=3), expected)
    assert_pool_clean(hf_paged_kv.pool_of(model))


def test_a_row_never_inherits_a_block_of_another_chain_than_its_parent(model):
    """The tenant holds the first block, the published chain the first two: a row takes the
    published chain whole, not its own first block and then the published second, whose parent
    is another block. (It took both: the published parent stayed idle, counted as evictable
    while no eviction could take it, and `audit` failed while the row lived.)"""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=2))
    with PagedCache() as cache:
        model.generate(input_ids=torch.tensor([[5, 6, 9]]), past_key_values=cache, max_new_tokens=1, do_sample=False)
    hf_paged_kv.publish(model, [5, 6, 7, 8])
    with PagedCache() as chat:
        reply = model.generate(input_ids=torch.tensor([[5, 6, 7, 8, 10]]), past_key_values=chat, max_new_tokens=2,
                               do_sample=False)
        assert chat.inherited == [4]
        assert hf_paged_kv.cached_tokens(model, [5, 6, 7, 8, 10])["device"] == 4  # what admission probes too
        pool.audit()
        pool.decref(pool.allocate(pool.num_available()))  # every block counted as available can be had
    # the block the tenant computed after the published ones is found through them
    follow = torch.cat([reply, torch.tensor([[11]])], 1)
    with PagedCache() as cache:
        model.generate(input_ids=follow, past_key_values=cache, max_new_tokens=1, do_sample=False)
        assert cache.inherited == [6]
    assert_pool_clean(pool)


def test_a_prefix_whose_first_block_expired_before_the_second_is_indexed_again_whole(model):
    """With a TTL, a conversation's later turn indexes its blocks later, so a child outlives its
    parent. The prefix computed again after the parent expired re-indexes both blocks (the
    fresh twin of the second continued the expired parent: the new copy was never indexed, the
    prefix stopped at one block and pinning it failed)."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=4, ttl=5.0))
    clock = manual_clock(pool)
    prefix = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), PagedCache() as chat:
        model(input_ids=prefix[:, :5], past_key_values=chat)  # t=0: the first block, expiring at 5
        clock[0] = 3.0
        model(input_ids=prefix[:, 5:], past_key_values=chat)  # t=3: the second, expiring at 8
    clock[0] = 6.0
    pin = hf_paged_kv.pin(model, prefix[0].tolist())
    assert pin.tokens == 8 and hf_paged_kv.cached_tokens(model, prefix[0].tolist())["device"] == 8
    hf_paged_kv.unpin(model, pin)
    assert_pool_clean(pool)
