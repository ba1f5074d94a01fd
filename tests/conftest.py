"""Shared fixtures: tiny random-weight models of each supported architecture, and the real SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

# The Triton kernels run on the CPU only through the interpreter, which must be chosen before
# any kernel module is imported (hf_paged_kv imports them lazily, so here is early enough).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hf_paged_kv

VOCAB = 96
PAD, BOS, EOS = 0, 1, 2
# A large weight scale makes attention sharp: with transformers' default (0.02) attention is
# nearly uniform, and greedy tokens barely depend on which key goes with which value, at which
# position or with which scale, so equality tests could not see attention bugs
# (tests/test_planted_bugs.py shows that they do now).
COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.3)
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=1024, **COMMON)

ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **DECODER)),
    # A window shorter than the test prompts, so sliding attention is really exercised.
    "mistral": lambda: MistralForCausalLM(
        MistralConfig(num_attention_heads=4, num_key_value_heads=1, sliding_window=24, **DECODER)
    ),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(num_attention_heads=4, num_key_value_heads=4, **DECODER)),
    "qwen3": lambda: Qwen3ForCausalLM(
        Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, **DECODER)
    ),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **COMMON)),
    # no `head_dim` attribute (it has `head_size`), no `_supports_attention_backend` flag either
    "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(num_attention_heads=4, **DECODER)),
    # attention-logit soft-capping; transformers' sdpa ignores it, so the reference is eager
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                     sliding_window=16, attn_logit_softcapping=2.0,
                                                     attn_implementation="eager", **DECODER)),
}


def make_model(arch: str = "llama", seed: int = 0):
    """A tiny fp32 model with random weights, in eval mode."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch]().eval()
    model.generation_config.pad_token_id = PAD
    return model


def random_batch(batch: int, length: int, seed: int = 0, max_pad: int | None = None):
    """Left-padded random prompts: `(input_ids, attention_mask)`; row 0 is never padded."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    max_pad = length - 1 if max_pad is None else max_pad
    for row in range(1, batch):
        pad = int(torch.randint(0, max_pad + 1, (1,), generator=gen))
        mask[row, :pad] = 0
        ids[row, :pad] = PAD
    return ids, mask


def greedy(model, cache, ids, mask, new_tokens=12, **kwargs):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        past_key_values=cache,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls gain nothing from intra-op threads, and on a shared machine lose a lot: a
    module of many tiny models runs on one (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def llama():
    model = make_model("llama")
    yield model
    hf_paged_kv.disable(model)


def manual_clock(pool) -> list[float]:
    """Make `pool`'s policy read the time from the returned one-item list: `clock[0] = 5.0`."""
    clock = [0.0]
    pool.policy.clock = lambda: clock[0]
    return clock


def droppable(metas: dict, now: float) -> list:
    """The reference scan `LeafQueue` must agree with: the keys of `metas` a tier may drop without
    stranding another block it holds, leaves (no block held names them as its parent) and
    expired blocks (nothing past an expired block is reachable either)."""
    parents = {m.parent for m in metas.values()}
    return [key for key, m in metas.items() if m.expired(now) or m.digest not in parents]


def assert_pool_clean(pool):
    """After every request finished, each block is free or cached with reference count 0, apart
    from the references pins and semantic entries hold: nothing leaked, and the counts add up."""
    report = pool.audit()  # raises on inconsistent bookkeeping
    assert report["references"] == report["references_by_pins"] + report["references_by_semantic"], report
    stats = pool.stats()
    assert stats["blocks_free"] + stats["blocks_cached"] + stats["blocks_used"] == stats["num_blocks"], stats


def fragment(pool) -> list[int]:
    """Hold every other block of the pool, so that no two free blocks are neighbours and every
    sequence of more than one block gets a fragmented table; returns the held blocks (decref
    them when done)."""
    taken = pool.allocate(pool.num_free())
    pool.decref(taken[1::2])
    return taken[::2]


class ForwardWidths:
    """Records how many input columns each forward of `model` really computed (after prefix
    reuse dropped the cached ones), through a hook on the input embeddings."""

    def __init__(self, model):
        self.widths: list[int] = []
        self.handle = model.get_input_embeddings().register_forward_hook(
            lambda module, args, output: self.widths.append(output.shape[1]))

    def remove(self):
        self.handle.remove()


@pytest.fixture(scope="session")
def smollm2():
    return real_model().load_smollm2()


def real_model():
    """The demo's SmolLM2 loader, examples/real_model.py (the library ships no model loader)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "real_model.py"
    spec = importlib.util.spec_from_file_location("real_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
