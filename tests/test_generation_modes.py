"""transformers-style generation checks: every generation mode, on tiny configs of the main
architectures, with left padding, right padding and a mask with holes. PagedCache must give
exactly what the default cache gives (fp32; tokens equal, scores within float noise)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import PAD, VOCAB, assert_pool_clean, make_model
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache

ARCHS = ["llama", "mistral", "qwen2", "gpt2", "gpt_neox", "gemma2"]
MASKS = ["left", "right", "holes"]
NEW = 6


def masked_batch(kind: str, rows: int = 3, width: int = 20, seed: int = 0):
    """Random prompts with padding on the left, on the right, or holes inside the rows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, width), generator=gen)
    mask = torch.ones_like(ids)
    pads = {"left": [range(0), range(0, 5), range(0, 11)],
            "right": [range(0), range(width - 5, width), range(width - 11, width)],
            "holes": [range(5, 7), range(2, 3), range(9, 13)]}[kind]
    for row in range(rows):
        mask[row, list(pads[row % 3])] = 0
    if kind == "holes":
        mask[1, 0:2] = 0  # a row may also start padded
    ids[mask == 0] = PAD
    return ids, mask


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


def run(model, cache_factory, **kwargs):
    """`generate` with a cache from `cache_factory` (None: the default cache)."""
    cache = cache_factory() if cache_factory is not None else None
    if cache is not None:
        kwargs["past_key_values"] = cache
    out = model.generate(**kwargs)
    if isinstance(cache, PagedCache):
        cache.release()
    return out


def compare(model, check, **kwargs):
    """Run `generate(**kwargs)` with DynamicCache, then paged; `check(paged, reference)`."""
    seed = kwargs.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        expected = run(model, DynamicCache, **kwargs)
    except (RuntimeError, ValueError) as error:  # e.g. assisted decoding with sliding windows; no inputs_embeds
        pytest.skip(f"transformers' own generate fails here with DynamicCache: {error}")
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=128, block_size=4))
    try:
        if seed is not None:
            torch.manual_seed(seed)
        got = run(model, PagedCache, **kwargs)
        check(got, expected)
        assert_pool_clean(pool)
    finally:
        hf_paged_kv.disable(model)


def same_tokens(got, expected):
    sequences = lambda out: out if torch.is_tensor(out) else out.sequences  # noqa: E731
    torch.testing.assert_close(sequences(got), sequences(expected), rtol=0, atol=0)


MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, temperature=0.9, top_k=30, seed=7),
    "beam_search": dict(num_beams=3, do_sample=False),
    "beam_sampling": dict(num_beams=2, do_sample=True, seed=3),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=2, seed=5),
    "min_max_new_tokens": dict(do_sample=False, min_new_tokens=3, max_new_tokens=NEW, eos_token_id=list(range(3, 40))),
}


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_generation_mode(arch, mode, mask_kind):
    ids, mask = masked_batch(mask_kind)
    options = dict(MODES[mode])
    options.setdefault("max_new_tokens", NEW)
    compare(make_model(arch), same_tokens, input_ids=ids, attention_mask=mask, **options)


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("mode", ["assisted", "prompt_lookup"])
def test_candidate_decoding(arch, mode, mask_kind):
    """Assisted decoding and prompt lookup (batch 1, as transformers requires): the paged cache
    is cropped back after rejected candidates."""
    ids, mask = masked_batch(mask_kind)
    row = 2 if mask_kind != "holes" else 1
    ids, mask = ids[row : row + 1], mask[row : row + 1]
    extra = dict(assistant_model=make_model(arch, seed=11)) if mode == "assisted" else dict(prompt_lookup_num_tokens=3)
    compare(make_model(arch), same_tokens, input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
            **extra)


@pytest.mark.parametrize("mask_kind", MASKS)
def test_inputs_embeds(arch, mask_kind):
    ids, mask = masked_batch(mask_kind)
    model = make_model(arch)
    embeds = model.get_input_embeddings()(ids)
    compare(model, same_tokens, inputs_embeds=embeds, attention_mask=mask, max_new_tokens=NEW, do_sample=False)


@pytest.mark.parametrize("mask_kind", MASKS)
def test_scores_and_logits(arch, mask_kind):
    ids, mask = masked_batch(mask_kind)

    def check(got, expected):
        same_tokens(got, expected)
        for name in ("scores", "logits"):
            for a, b in zip(getattr(got, name), getattr(expected, name)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    compare(make_model(arch), check, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
            return_dict_in_generate=True, output_scores=True, output_logits=True)


@pytest.mark.parametrize("mask_kind", MASKS)
def test_attentions_and_hidden_states(arch, mask_kind):
    """Attention weights over logical positions (zeros at pads) and hidden states of every step,
    against the eager attention (the default sdpa returns no weights). A leading pad query sees
    no key at all: eager spreads it uniformly over the masked keys, sdpa and hf_paged_kv give
    zeros; such queries are left out."""
    ids, mask = masked_batch(mask_kind)
    model = make_model(arch)
    model.set_attn_implementation("eager")

    def check(got, expected):
        same_tokens(got, expected)
        sees_a_token = mask.cumsum(1) > 0
        for step_got, step_expected in zip(got.attentions, expected.attentions):
            queries = sees_a_token if step_got[0].shape[2] > 1 else slice(None)
            for a, b in zip(step_got, step_expected):
                torch.testing.assert_close(a.transpose(1, 2)[queries], b.transpose(1, 2)[queries], rtol=1e-4, atol=1e-5)
        for step_got, step_expected in zip(got.hidden_states, expected.hidden_states):
            real = slice(None) if step_got[0].shape[1] == 1 else mask.bool()
            for a, b in zip(step_got, step_expected):
                torch.testing.assert_close(a[real], b[real], rtol=1e-4, atol=1e-4)

    compare(model, check, input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
            return_dict_in_generate=True, output_attentions=True, output_hidden_states=True)


@pytest.mark.parametrize("mask_kind", MASKS)
def test_continuation_from_a_returned_cache(arch, mask_kind):
    """Generate, then continue the same cache with more tokens (what a chat loop does)."""
    ids, mask = masked_batch(mask_kind)
    follow = torch.randint(3, VOCAB, (3, 4), generator=torch.Generator().manual_seed(9))
    model = make_model(arch)

    def two_calls(cache):
        first = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4,
                               do_sample=False, return_dict_in_generate=True)
        second_ids = torch.cat([first.sequences, follow], 1)
        second_mask = torch.cat([mask, torch.ones(3, second_ids.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        return model.generate(input_ids=second_ids, attention_mask=second_mask, past_key_values=first.past_key_values,
                              max_new_tokens=4, do_sample=False)

    expected = two_calls(DynamicCache())
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=128, block_size=4))
    with PagedCache() as cache:
        torch.testing.assert_close(two_calls(cache), expected, rtol=0, atol=0)
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


def test_mask_absent_equals_mask_of_ones(arch):
    ids = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))  # no pad id to infer a mask from
    model = make_model(arch)
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    outputs = []
    for mask in (None, torch.ones_like(ids)):
        with PagedCache() as cache:
            outputs.append(model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                                          max_new_tokens=NEW, do_sample=False))
    hf_paged_kv.disable(model)
    expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mask_kind", MASKS)
def test_forward_logits_to_keep(arch, mask_kind):
    """A plain forward with `logits_to_keep` (0: all positions; N: the last N), paged against
    the default cache, at the real positions (pad positions' logits match too where they see a
    real token)."""
    ids, mask = masked_batch(mask_kind)
    model = make_model(arch)

    def forward(cache, keep):
        return model(input_ids=ids, attention_mask=mask, past_key_values=cache, logits_to_keep=keep).logits

    for keep in (0, 5):
        expected = forward(DynamicCache(), keep)
        hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
        with PagedCache() as cache:
            got = forward(cache, keep)
        hf_paged_kv.disable(model)
        sees_a_token = (mask.cumsum(1) > 0)[:, -got.shape[1]:]
        torch.testing.assert_close(got[sees_a_token], expected[sees_a_token], rtol=1e-4, atol=1e-4)


def test_deepcopy_shares_blocks_and_continues_independently(arch):
    """transformers' recipe: prefill a shared prompt once, deep-copy the cache per request."""
    model = make_model(arch)
    prompt = torch.randint(3, VOCAB, (1, 18), generator=torch.Generator().manual_seed(4))
    questions = [torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 6)]

    def answers(cache_factory):
        with torch.no_grad():
            prompt_cache = model(input_ids=prompt, past_key_values=cache_factory()).past_key_values
        out = []
        for question in questions:
            ids = torch.cat([prompt, question], 1)
            out.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      past_key_values=copy.deepcopy(prompt_cache), max_new_tokens=NEW, do_sample=False))
        return out, prompt_cache

    expected, _ = answers(DynamicCache)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    got, prompt_cache = answers(lambda: PagedCache(reuse=False))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert pool.audit()["references"] == sum(len(t) for t in prompt_cache.block_tables())  # copies freed their own
    prompt_cache.release()
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)
