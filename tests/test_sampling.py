"""The engine's sampling parameters beyond temperature, top-k and top-p: repetition, presence and
frequency penalties, logit bias, `min_tokens` and min-p. Each request's tokens equal `generate`
with the same parameters (transformers' processors, or the OpenAI formula as a processor of its
own), whatever the request is batched with."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, assert_pool_clean, make_model
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import hf_paged_kv
from hf_paged_kv import Engine, KVPool

EOS = 2  # the tiny models' EOS token


def prompts(lengths, seed=0):
    return [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed + i)).tolist()
            for i, n in enumerate(lengths)]


class OccurrencePenalty(LogitsProcessor):
    """OpenAI's presence and frequency penalties, over the generated tokens: the reference."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids[:, self.prompt_length:]):
            counts = torch.bincount(ids, minlength=scores.shape[-1])[: scores.shape[-1]].to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def generated(model, prompt, new, **kwargs):
    """`generate` for this request alone, greedy, cut after its first EOS as the engine ends it."""
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(),
                         max_new_tokens=new, do_sample=False, eos_token_id=EOS, pad_token_id=0, **kwargs)
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    model = make_model(request.param, seed=5)
    yield model
    hf_paged_kv.disable(model)


def test_penalties_bias_and_min_tokens_equal_generate_batched_together(model):
    batch = prompts([7, 19, 12, 30, 5, 16])
    eos_first = {EOS: 100.0}  # EOS would win every step: min_tokens alone holds it back
    cases = [  # (engine arguments, generate's)
        (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
        (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
        (dict(logit_bias={11: 4.0, 12: -100.0}), dict(sequence_bias={(11,): 4.0, (12,): -100.0})),
        (dict(logit_bias=eos_first, min_tokens=4), dict(sequence_bias={(EOS,): 100.0}, min_new_tokens=4)),
        (dict(presence_penalty=1.5, frequency_penalty=0.5), None),
        ({}, {}),  # a plain row in the same batches
    ]
    expected = []
    for prompt, (_, theirs) in zip(batch, cases):
        if theirs is None:
            theirs = dict(logits_processor=LogitsProcessorList([OccurrencePenalty(len(prompt), 1.5, 0.5)]))
        expected.append(generated(model, prompt, 12, **theirs))
    assert expected[3] == expected[3][:4] + [EOS] and EOS not in expected[3][:4]  # the case tests something
    pool = KVPool(num_blocks=64, block_size=8)
    with Engine(model, pool=pool, max_batch_tokens=40) as engine:
        handles = [engine.submit(p, max_new_tokens=12, eos_token_id=EOS, **ours) for p, (ours, _) in zip(batch, cases)]
        assert [h.result(timeout=120) for h in handles] == expected
    plain = [generated(model, p, 12) for p in batch[:5]]
    assert all(e != p for e, p in zip(expected, plain))  # every parameter changed its request's tokens
    assert_pool_clean(pool)


def test_min_p_keeps_only_tokens_near_the_top_one(model):
    """min_p = 1 keeps the top token alone: sampling gives the greedy tokens; a seeded request with
    min_p repeats itself."""
    prompt = prompts([9], seed=3)[0]
    greedy = generated(model, prompt, 10)
    with Engine(model, pool=KVPool(num_blocks=32, block_size=8)) as engine:
        top_only = engine.submit(prompt, max_new_tokens=10, eos_token_id=EOS, do_sample=True, temperature=1.5,
                                 min_p=1.0, seed=1).result(timeout=60)
        first, again = (engine.submit(prompt, max_new_tokens=10, eos_token_id=EOS, do_sample=True, min_p=0.05,
                                      seed=7).result(timeout=60) for _ in range(2))
        unfiltered = engine.submit(prompt, max_new_tokens=10, eos_token_id=EOS, do_sample=True, temperature=1.5,
                                   seed=1).result(timeout=60)
    assert top_only == greedy and first == again
    assert unfiltered != greedy  # at this temperature sampling leaves the argmax: min_p = 1 brought it back


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_p=1.5), "min_p must be in \\[0, 1\\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be a finite number"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty must be a finite number"),
    (dict(min_tokens=20), "min_tokens must be in \\[0, max_new_tokens=8\\]"),
    (dict(min_tokens=-1), "min_tokens must be in"),
    (dict(logit_bias={VOCAB: 1.0}), f"logit_bias names tokens outside the model's vocabulary of {VOCAB}"),
    (dict(logit_bias={5: float("nan")}), "logit_bias values must be finite"),
    (dict(logit_bias={"5": 1.0}), "a logit_bias token must be an integer"),
])
def test_bad_sampling_parameters_are_refused_at_submit(kwargs, message):
    model = make_model("llama", seed=5)
    engine = Engine(model, pool=KVPool(num_blocks=16, block_size=8))
    with engine:
        with pytest.raises(ValueError, match=message):
            engine.submit([5, 6, 7], max_new_tokens=8, **kwargs)
        assert engine.stats()["requests_waiting"] == 0
    hf_paged_kv.disable(model)


def test_logprobs_are_the_models_log_softmax_of_each_chosen_token(model):
    prompt = prompts([11], seed=8)[0]
    with Engine(model, pool=KVPool(num_blocks=32, block_size=8)) as engine:
        handle = engine.submit(prompt, max_new_tokens=6, eos_token_id=[], logprobs=3, repetition_penalty=1.3)
        tokens = handle.result(timeout=60)
        plain = engine.submit(prompt, max_new_tokens=2, eos_token_id=[])
        plain.result(timeout=60)
    entries = handle.request.logprobs
    assert len(entries) == len(tokens) == 6 and plain.request.logprobs == []
    for i, (token, (logprob, top)) in enumerate(zip(tokens, entries)):
        with torch.no_grad():
            scores = model(torch.tensor([prompt + tokens[:i]])).logits[0, -1].float().log_softmax(-1)
        assert logprob == pytest.approx(float(scores[token]), abs=1e-4)  # before the penalty: the model's own
        best = scores.topk(3)
        assert [t for t, _ in top] == best.indices.tolist()
        assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-4)
    with Engine(model, pool=KVPool(num_blocks=16, block_size=8)) as engine:
        with pytest.raises(ValueError, match="logprobs must be in \\[0, 20\\]"):
            engine.submit(prompt, max_new_tokens=2, logprobs=21)
