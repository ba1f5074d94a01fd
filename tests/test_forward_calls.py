"""The ways an enabled model gets called beyond `generate`'s own: arguments by position, an
attention implementation or a compile applied after `enable`, masks that do not describe the
cache, and models whose attention is not causal throughout. Each either matches DynamicCache or
is refused with a clear error, with nothing stored that a later request could inherit."""

from __future__ import annotations

import pytest
import torch
from conftest import PAD, VOCAB, assert_pool_clean, greedy, make_model, random_batch
from transformers import (
    DynamicCache,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, PagedKVError, UnsupportedModelError


def test_a_mask_and_a_cache_passed_by_position_are_used(llama):
    """`model(ids, mask, ...)`: the mask passed by position was ignored (every pad stored and
    attended: logits off by 9.6); the cache passed by position was not seen at all."""
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64, block_size=4))
    ids, mask = random_batch(3, 20, seed=4)
    with torch.no_grad():
        expected = llama(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache()).logits
        with PagedCache() as cache:
            by_position = llama(ids, mask, past_key_values=cache).logits
            assert cache.row_lengths() == mask.sum(1).tolist()
        with PagedCache() as cache:
            cache_by_position = llama(ids, mask, None, cache).logits
    real = mask.bool()
    torch.testing.assert_close(by_position[real], expected[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache_by_position[real], expected[real], atol=1e-4, rtol=1e-4)


def test_an_attention_implementation_switched_after_enable_stores_nothing(llama):
    """A forward whose layers ran another attention never wrote its blocks: it is refused, and
    nothing of it is indexed (a later request inherited the unwritten blocks and gave other tokens)."""
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64, block_size=4))
    ids, mask = random_batch(2, 16, seed=5)
    expected = greedy(llama, DynamicCache(), ids, mask, new_tokens=6)
    llama.set_attn_implementation("eager")
    with PagedCache() as cache, pytest.raises(PagedKVError, match="0 of the model's 2 attention layers ran"):
        llama(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert pool.stats()["blocks_cached"] == 0
    llama.set_attn_implementation(hf_paged_kv.integration.hooks.ATTENTION_NAME)
    with PagedCache() as cache:
        assert torch.equal(greedy(llama, cache, ids, mask, new_tokens=6), expected)
    assert_pool_clean(pool)


def test_compiling_after_enable_is_refused_and_before_enable_works(llama):
    ids, mask = random_batch(2, 12, seed=6)
    expected = greedy(llama, DynamicCache(), ids, mask, new_tokens=4)
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64, block_size=4))
    llama.forward = torch.compile(llama.forward, backend="eager")
    with PagedCache() as cache, pytest.raises(PagedKVError, match="compile it first, then enable"):
        greedy(llama, cache, ids, mask, new_tokens=4)
    hf_paged_kv.disable(llama)
    del llama.forward  # the compiled wrapper: the class's forward again
    llama.forward = torch.compile(llama.forward, backend="eager")
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64, block_size=4))
    with PagedCache() as cache:
        assert torch.equal(greedy(llama, cache, ids, mask, new_tokens=4), expected)


def test_a_continued_cache_needs_a_mask_over_what_it_holds(llama):
    """Without a mask every position is attended, pads included, which a PagedCache never
    stored; a mask of the new columns alone says nothing of the held ones. Both are refused,
    and the cache goes on with the right mask."""
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64, block_size=4))
    ids, mask = random_batch(2, 12, seed=7, max_pad=4)
    mask[1, :3] = 0
    step = torch.randint(3, VOCAB, (2, 1), generator=torch.Generator().manual_seed(8))
    full = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    with torch.no_grad(), PagedCache() as cache:
        dynamic = DynamicCache()
        llama(input_ids=ids, attention_mask=mask, past_key_values=cache)
        llama(input_ids=ids, attention_mask=mask, past_key_values=dynamic)
        with pytest.raises(PagedKVError, match="no attention_mask.*row 1 holds pads"):
            llama(input_ids=step, past_key_values=cache)
        with pytest.raises(PagedKVError, match="covers 1 positions; this forward needs 13"):
            llama(input_ids=step, attention_mask=torch.ones(2, 1, dtype=mask.dtype), past_key_values=cache)
        got = llama(input_ids=step, attention_mask=full, past_key_values=cache).logits
        expected = llama(input_ids=step, attention_mask=full, past_key_values=dynamic).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_bidirectional_text_model_is_refused_at_enable():
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=PAD,
                              use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match="bidirectional attention is not supported"):
        hf_paged_kv.enable(Gemma3ForCausalLM(config).eval())


def test_an_image_whose_tokens_attend_to_each_other_is_refused_and_the_vision_tower_keeps_its_attention():
    """Gemma-3 with an image: the vision tower (no paged layers) runs its own attention; the
    language model's mask lets image tokens attend to later image tokens, which the causal
    backends cannot do: refused, nothing stored. A prompt without an image matches DynamicCache
    (its mask carries the overlay too, with no token in a block)."""
    text = Gemma3TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=PAD)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=4)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_id=100,
                          boi_token_index=98, eoi_token_index=99)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = PAD
    ids = torch.tensor([[1, 5, 6, 98] + [100] * 4 + [99, 7, 8, 9, 10]])
    image = dict(token_type_ids=(ids == 100).long(), pixel_values=torch.randn(1, 3, 16, 16))
    plain = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])
    # token types of zeros, as Gemma3Processor gives every prompt: the block overlay is then a no-op
    text = dict(input_ids=plain, token_type_ids=torch.zeros_like(plain), max_new_tokens=5, do_sample=False)
    expected = model.generate(past_key_values=DynamicCache(), **text)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    try:
        with PagedCache() as cache, pytest.raises(UnsupportedModelError, match="image tokens attending to each other"):
            model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=5, do_sample=False, **image)
        assert pool.stats()["blocks_cached"] == 0
        with PagedCache() as cache:
            got = model.generate(past_key_values=cache, **text)
        assert torch.equal(got, expected)
        assert_pool_clean(pool)
    finally:
        hf_paged_kv.disable(model)


def test_assisted_decoding_on_a_continued_cache_is_refused(llama):
    """transformers' assisted decoding feeds a continued cache the whole conversation again, with
    a mask of that width (DynamicCache then masks its own new keys): refused, nothing changed."""
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64, block_size=4))
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(9))
    assistant = make_model("llama", seed=42)
    with PagedCache() as cache:
        reply = llama.generate(input_ids=ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        held = cache.row_lengths()
        follow = torch.cat([reply, ids[:, :5]], 1)
        refused = r"the attention_mask covers \d+ positions; this forward needs \d+: the 23 this PagedCache holds"
        with pytest.raises(PagedKVError, match=refused):
            llama.generate(input_ids=follow, past_key_values=cache, assistant_model=assistant, max_new_tokens=4,
                           do_sample=False)
        assert cache.row_lengths() == held


def test_a_model_built_on_an_enabled_models_config_is_refused_and_the_first_goes_on(llama):
    """The config object carries the attention implementation: a second model on it cannot be
    enabled (its fallback attention would be the paged one), and refusing it leaves the first as it was."""
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64, block_size=4))
    ids, mask = random_batch(1, 10, seed=10)
    twin = type(llama)(llama.config).eval()
    with pytest.raises(PagedKVError, match="give each model its own config object"):
        hf_paged_kv.enable(twin)
    with PagedCache() as cache:
        assert torch.equal(greedy(llama, cache, ids, mask, new_tokens=4), greedy(llama, DynamicCache(), ids, mask,
                                                                                  new_tokens=4))
