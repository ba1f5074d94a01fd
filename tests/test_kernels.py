"""Triton kernels against the torch reference (under TRITON_INTERPRET=1 on the CPU).

Inputs are fresh random tensors with shuffled, non-contiguous block tables. Pool slots that no
row may read hold large values (so a stray read changes the answer) and output buffers start as
NaN (so an element the kernel forgot to write is caught).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_paged_kv import PagedKVError
from hf_paged_kv.kernels import reference
from hf_paged_kv.kernels.paged_decode import paged_decode
from hf_paged_kv.kernels.paged_prefill import paged_prefill, prefill_tiles
from hf_paged_kv.kernels.triton_utils import check_dot_shape
from hf_paged_kv.kernels.write_kv import write_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
POISON = 300.0


def pool_with_rows(kv_lens, block_size, kv_heads, head_dim, dtype, gen, spare_blocks, device=DEVICE):
    """A pool poisoned everywhere except the rows' slots, which hold random K/V, and the rows'
    shuffled block tables; `spare_blocks` blocks (block 0 among them) stay unused."""
    num_blocks = sum(-(-n // block_size) for n in kv_lens) + spare_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.full(shape, POISON, dtype=dtype, device=device)
    value_cache = torch.full(shape, -POISON, dtype=dtype, device=device)
    tables = make_rows(kv_lens, block_size, num_blocks, gen)
    fill_rows(key_cache, value_cache, tables, kv_lens, gen)
    return key_cache, value_cache, tables


def make_rows(kv_lens, block_size, num_blocks, gen):
    """Shuffled block tables for rows of `kv_lens` tokens, padded with -1; block 0 stays unused."""
    needed = [-(-n // block_size) for n in kv_lens]
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.full((len(kv_lens), max(max(needed), 1) + 1), -1, dtype=torch.int32)
    for row, n in enumerate(needed):
        tables[row, :n] = torch.tensor(order[:n], dtype=torch.int32)
        del order[:n]
    return tables


def fill_rows(key_cache, value_cache, tables, kv_lens, gen):
    """Random K/V in every valid slot of every row (the poison stays everywhere else)."""
    block_size, kv_heads, head_dim = key_cache.shape[1:]
    for row, n in enumerate(kv_lens):
        for pos in range(n):
            block = int(tables[row, pos // block_size])
            for cache in (key_cache, value_cache):
                cache[block, pos % block_size] = torch.randn(kv_heads, head_dim, generator=gen).to(cache.dtype)


def reference_attention(query4d, key_cache, value_cache, tables, kv_lens, q_pos, scale, window):
    """The torch reference in fp32, reading the same (poisoned) pool with the poison masked out."""
    clean_k, clean_v = key_cache.float().clone(), value_cache.float().clone()
    return reference.paged_attention(
        query4d.float(), clean_k, clean_v, tables, kv_lens, q_pos, scale, window
    )


DECODE_CASES = [  # (group, head_dim, block_size, dtype)
    (1, 64, 16, torch.float32),
    (4, 96, 32, torch.float16),
    (5, 128, 64, torch.bfloat16),
    (7, 64, 32, torch.float32),
    (4, 128, 16, torch.bfloat16),
    (7, 96, 64, torch.float16),
    (5, 64, 16, torch.float16),
    (1, 128, 32, torch.bfloat16),
]


@pytest.mark.parametrize("group, head_dim, block_size, dtype", DECODE_CASES)
@pytest.mark.parametrize("window, splits", [(None, 1), (None, 3), (37, 2)])
def test_paged_decode_matches_reference(group, head_dim, block_size, dtype, window, splits):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + block_size)
    kv_heads, kv_lens = 2, [1, 150, 77, 0]
    key_cache, value_cache, tables = pool_with_rows(kv_lens, block_size, kv_heads, head_dim, dtype, gen, 6)
    batch, heads = len(kv_lens), kv_heads * group
    query = torch.randn(batch, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    q_pos = (lens.long() - 1).clamp_min(0)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    got = paged_decode(
        query, key_cache, value_cache, tables.to(DEVICE), lens, q_pos, scale, window, num_splits=splits, out=out
    )
    expected = reference_attention(query[:, :, None], key_cache, value_cache, tables.to(DEVICE), lens, q_pos[:, None],
                                   scale, window)[:, :, 0]
    assert got is out and not got.isnan().any()
    real = lens > 0
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[real].float(), expected[real], rtol=tol, atol=tol)
    assert (got[~real] == 0).all()  # a row without keys gets zeros, not garbage


PREFILL_CASES = [  # (group, head_dim, block_size, dtype)
    (1, 64, 16, torch.float32),
    (4, 96, 32, torch.bfloat16),
    (5, 128, 64, torch.float16),
    (7, 64, 16, torch.bfloat16),
    (4, 128, 32, torch.float32),
]


@pytest.mark.parametrize("group, head_dim, block_size, dtype", PREFILL_CASES)
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["cpu-tiles", "gpu-tiles"])
def test_paged_prefill_matches_reference(group, head_dim, block_size, dtype, window, gpu_tiles):
    """The GPU's tiles (`prefill_tiles`) computed here too, not only the CPU's."""
    gen = torch.Generator().manual_seed(group * 100 + head_dim + block_size)
    kv_heads = 1
    prefixes, news, width = [0, 45, 13], [40, 7, 33], 40  # varlen: prefix and new lengths per row
    kv_lens = [p + n for p, n in zip(prefixes, news)]
    key_cache, value_cache, tables = pool_with_rows(kv_lens, block_size, kv_heads, head_dim, dtype, gen, 5)
    heads = kv_heads * group
    query = torch.randn(3, heads, width, head_dim, generator=gen).to(dtype).to(DEVICE)
    q_pos = torch.zeros(3, width, dtype=torch.long)
    real = torch.zeros(3, width, dtype=torch.bool)
    for row, (p, n) in enumerate(zip(prefixes, news)):  # new tokens left-padded, as generate gives them
        q_pos[row, width - n :] = torch.arange(p, p + n)
        real[row, width - n :] = True
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    got = paged_prefill(query, key_cache, value_cache, tables.to(DEVICE), lens, q_pos.to(DEVICE), scale, window,
                        out=out, tiles=prefill_tiles(dtype, gpu_tiles))
    expected = reference_attention(query, key_cache, value_cache, tables.to(DEVICE), lens, q_pos.to(DEVICE), scale,
                                   window)
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    real = real.to(DEVICE)
    torch.testing.assert_close(got.transpose(1, 2)[real].float(), expected.transpose(1, 2)[real], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_and_skips_pads(dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_dim = 9, 16, 3, 96
    key = torch.randn(2, kv_heads, 7, head_dim, generator=gen).to(dtype).to(DEVICE)  # [B, H, T, D] as transformers
    value = torch.randn(2, kv_heads, 7, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:14].view(2, 7)
    slots[0, :3] = -1  # pads
    slots = slots.to(DEVICE)
    got = [torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
           for _ in range(2)]
    expected = [c.clone() for c in got]
    write_kv(*got, key.transpose(1, 2), value.transpose(1, 2), slots)  # strided views, no copy
    reference.write_kv(*expected, key.transpose(1, 2).reshape(14, kv_heads, head_dim),
                       value.transpose(1, 2).reshape(14, kv_heads, head_dim), slots.reshape(-1))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)
    assert got[0].isnan().sum() == (num_blocks * block_size - 11) * kv_heads * head_dim  # nothing else touched


def test_offsets_are_int64_for_pools_over_2_31_elements():
    """A pool of more than 2^31 elements; only its last blocks are ever touched (the rest of the
    allocation is never paged in)."""
    block_size, kv_heads, head_dim = 16, 1, 64
    num_blocks = 2**31 // (block_size * kv_heads * head_dim) + 4
    key_cache = torch.empty((num_blocks, block_size, kv_heads, head_dim), dtype=torch.float16, device=DEVICE)
    value_cache = torch.empty_like(key_cache)
    assert key_cache.numel() > 2**31
    gen = torch.Generator().manual_seed(0)
    tables = torch.tensor([[num_blocks - 1, num_blocks - 3]], dtype=torch.int32, device=DEVICE)
    key = torch.randn(1, 20, kv_heads, head_dim, generator=gen).half().to(DEVICE)
    value = torch.randn(1, 20, kv_heads, head_dim, generator=gen).half().to(DEVICE)
    positions = torch.arange(20, device=DEVICE)
    slots = (tables[0, positions // block_size].long() * block_size + positions % block_size)[None]
    write_kv(key_cache, value_cache, key, value, slots)
    assert torch.equal(key_cache[num_blocks - 3, :4], key[0, 16:])
    query = torch.randn(1, 1, head_dim, generator=gen).half().to(DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    got = paged_decode(query, key_cache, value_cache, tables, lens, lens.long() - 1, 0.125)
    expected = reference.sdpa(query[:, :, None].float(), key.transpose(1, 2).float(), value.transpose(1, 2).float(),
                              None, 0.125)[:, :, 0]
    torch.testing.assert_close(got.float(), expected, rtol=3e-3, atol=3e-3)


def test_gpu_dot_limits_are_checked_on_every_platform(monkeypatch):
    with pytest.raises(PagedKVError, match="below the GPU minimum of 16"):
        check_dot_shape(8, 64, 64)
    from hf_paged_kv.kernels import paged_prefill as module

    monkeypatch.setattr(module, "BLOCK_M", 8)
    query = torch.zeros(1, 1, 4, 64, dtype=torch.float16, device=DEVICE)
    cache = torch.zeros(2, 16, 1, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(PagedKVError, match="tl.dot tile 8x32x64"):
        module.paged_prefill(query, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                             torch.zeros(1, 4, dtype=torch.long), 1.0)


@pytest.mark.parametrize(
    "query_shape, cache_dtype, message",
    [
        ((1, 2, 32), torch.float32, "head dims"),
        ((1, 2, 64), torch.float64, "fp32/fp16/bf16"),
        ((1, 3, 64), torch.float32, "not a multiple"),
    ],
)
def test_unsupported_combinations_are_refused(query_shape, cache_dtype, message):
    head_dim = query_shape[-1]
    query = torch.zeros(query_shape, dtype=cache_dtype, device=DEVICE)
    cache = torch.zeros(2, 16, 2, head_dim, dtype=cache_dtype, device=DEVICE)
    with pytest.raises(PagedKVError, match=message):
        paged_decode(query, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                     torch.zeros(1, dtype=torch.long), 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter error")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    query, cache = torch.zeros(1, 2, 64), torch.zeros(2, 16, 2, 64)
    with pytest.raises(PagedKVError, match="TRITON_INTERPRET=1"):
        paged_decode(query, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                     torch.zeros(1, dtype=torch.long), 1.0)


def test_generate_with_triton_backend_matches_torch_backend():
    """End to end: a left-padded batch and a second turn, Triton kernels against the torch backend."""
    from conftest import VOCAB, greedy, random_batch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_paged_kv
    from hf_paged_kv import KVPool, PagedCache

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, pad_token_id=0)
    model = LlamaForCausalLM(config).eval().to(DEVICE)
    ids, mask = random_batch(3, 40, seed=1)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    follow = torch.randint(3, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def two_turns(backend):
        hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=16), backend=backend)
        with PagedCache() as cache:
            first = greedy(model, cache, ids, mask, new_tokens=6)
            second_mask = torch.cat([mask, torch.ones(3, 11, dtype=mask.dtype, device=DEVICE)], 1)
            second = greedy(model, cache, torch.cat([first, follow], 1), second_mask, new_tokens=6)
        hf_paged_kv.disable(model)
        return first, second

    for got, expected in zip(two_turns("triton"), two_turns("torch")):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_head_dims_the_kernels_lack_run_on_the_torch_path_of_the_triton_backend():
    """The tiny test models' head dim 16 (like Phi-2's 80 or Gemma's 256) is not a kernel
    variant: the Triton backend attends with the torch path on the same device instead of
    failing the forward, with the same tokens as the torch backend."""
    from conftest import greedy, make_model, random_batch

    import hf_paged_kv
    from hf_paged_kv import KVPool, PagedCache

    model = make_model("llama", seed=3).to(DEVICE)  # head dim 16
    ids, mask = (t.to(DEVICE) for t in random_batch(2, 12, seed=4))

    def run(backend):
        hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=8), backend=backend)
        with PagedCache() as cache:
            out = greedy(model, cache, ids, mask, new_tokens=4)
        hf_paged_kv.disable(model)
        return out

    torch.testing.assert_close(run("triton"), run("torch"), rtol=0, atol=0)


def test_split_counts_are_powers_of_two_so_few_variants_compile(monkeypatch):
    """Each split count is a compiled kernel variant: counts from 1 to 64 in powers of two only
    (a new one every 256 tokens of context would stall long generations on the compiler)."""
    from types import SimpleNamespace

    from hf_paged_kv.kernels import paged_decode as module

    monkeypatch.setattr(module.torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cuda = SimpleNamespace(type="cuda")
    counts = {module.choose_splits(batch, 3, length, cuda) for batch in (1, 4, 16, 32, 64)
              for length in range(1, 32768, 97)}
    assert counts <= {1, 2, 4, 8, 16, 32, 64} and len(counts) >= 5


def test_short_rows_decode_in_one_split_on_the_gpu(monkeypatch):
    """Below `SPLIT_FROM` keys one launch beats split + merge (measured on an H200); long rows
    of a small batch still spread over the GPU."""
    from types import SimpleNamespace

    from hf_paged_kv.kernels import paged_decode as module

    monkeypatch.setattr(module.torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cuda = SimpleNamespace(type="cuda")
    assert {module.choose_splits(batch, 8, length, cuda) for batch in (1, 16) for length in (1, 384, 2048, 4095)} == {1}
    assert module.choose_splits(1, 8, 8192, cuda) == 32 and module.choose_splits(16, 8, 8192, cuda) == 8


def test_auto_backend_is_torch_on_cpu_and_triton_on_cuda():
    from conftest import make_model

    import hf_paged_kv
    from hf_paged_kv.integration.hooks import state_of

    model = make_model("llama").to(DEVICE)
    hf_paged_kv.enable(model)
    assert state_of(model).backend.name == ("triton" if DEVICE == "cuda" else "torch")
    hf_paged_kv.disable(model)


@pytest.mark.skipif(DEVICE != "cuda", reason="counts host-device synchronizations of the CUDA path")
def test_no_synchronization_per_layer_on_cuda():
    """A paged decode step synchronizes with the GPU a fixed number of times (reading the new
    token ids), whatever the number of layers: never once per layer."""
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_paged_kv
    from hf_paged_kv import KVPool, PagedCache

    def syncs(layers: int) -> int:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                                             num_attention_heads=4, num_key_value_heads=2)).eval().to(DEVICE)
        hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=16))
        ids = torch.randint(3, 96, (2, 40), device=DEVICE)
        with PagedCache() as cache, torch.inference_mode():
            model(input_ids=ids, past_key_values=cache)
            step = torch.randint(3, 96, (2, 1), device=DEVICE)
            model(input_ids=step, past_key_values=cache)  # warm-up of the decode path
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model(input_ids=step, past_key_values=cache)
            torch.cuda.set_sync_debug_mode("default")
        hf_paged_kv.disable(model)
        return len(caught)

    assert syncs(2) == syncs(6) <= 4


@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 2.0), (7, 2.0)])
@pytest.mark.parametrize("gather_bytes", [64 << 20, 1000])
def test_torch_backend_packed_forward_matches_reference(window, softcap, gather_bytes, monkeypatch):
    """The serving engine's packed row on the torch backend: decodes of different lengths (one
    in a contiguous run, the others scattered) attend in padded batches (several when the
    gather budget is small or the lengths differ a lot), prefill chunks alone; each sequence's
    output equals the reference's for that sequence alone."""
    from types import SimpleNamespace

    from hf_paged_kv.backends import torch_backend
    from hf_paged_kv.backends.torch_backend import TorchBackend

    monkeypatch.setattr(torch_backend, "GATHER_BYTES", gather_bytes)
    from hf_paged_kv.cache.planner import plan_packed
    from hf_paged_kv.cache.sequence import Sequence

    gen = torch.Generator().manual_seed(5)
    block_size, kv_heads, heads, head_dim = 4, 2, 4, 16
    kv_lens, counts = [9, 30, 17, 4, 23, 13], [1, 6, 1, 4, 1, 1]
    # the torch backend on the CPU, whatever device the kernel tests run on
    key_cache, value_cache, tables = pool_with_rows(kv_lens, block_size, kv_heads, head_dim, torch.float32, gen, 3, "cpu")
    tables[5, :4] = torch.arange(tables.max() + 1, tables.max() + 5)  # a decode in one run of blocks
    key_cache = torch.cat([key_cache, torch.randn(4, block_size, kv_heads, head_dim, generator=gen)])
    value_cache = torch.cat([value_cache, torch.randn(4, block_size, kv_heads, head_dim, generator=gen)])
    sequences = [Sequence(blocks=[b for b in row.tolist() if b >= 0], length=n - c)
                 for row, n, c in zip(tables, kv_lens, counts)]
    plan = plan_packed(sequences, counts, block_size)
    assert plan.contiguous[5] >= 0 and (plan.contiguous[[0, 2, 4]] < 0).all()
    query = torch.randn(1, heads, sum(counts), head_dim, generator=gen)
    pool = SimpleNamespace(key_cache=[key_cache], value_cache=[value_cache])
    got, _ = TorchBackend(pool).attention(query, 0, plan, 0.25, window, softcap)
    for s, (n, c) in enumerate(zip(kv_lens, counts)):
        lo = int(plan.q_start[s])
        q_pos = torch.arange(n - c, n)[None]
        expected = reference.paged_attention(query[:, :, lo : lo + c], key_cache, value_cache, tables[s : s + 1],
                                             torch.tensor([n]), q_pos, 0.25, window, softcap)
        torch.testing.assert_close(got[:, :, lo : lo + c], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_cpu_decode_attention_pairs_query_heads_with_their_kv_heads(dtype, masked):
    """A decode step on the CPU: in fp32 each KV head's query heads attend as its queries
    (every key read once), checked against explicit softmax attention over expanded heads
    (query head h with KV head h // groups); in bf16 it stays SDPA's native GQA exactly (the
    grouped form rounds differently). Keys are the pool's head-interleaved view with a large
    first key (a sink, as real models have), rows of different lengths under a mask, a row that
    sees nothing gives zeros."""
    gen = torch.Generator().manual_seed(7)  # data on which the grouped form's bf16 rounding differs
    batch, kv_heads, groups, length, dim = 3, 3, 4, 600, 64
    pool = torch.randn(2, batch, length, kv_heads, dim, generator=gen)
    pool[0, :, 0] *= 8
    keys, values = (cache.transpose(1, 2) for cache in pool.to(dtype))  # [batch, kv_heads, length, dim] views
    query = torch.randn(batch, kv_heads * groups, 1, dim, generator=gen).to(dtype)
    mask = None
    if masked:
        mask = (torch.arange(length)[None] < torch.tensor([length, 170, 0])[:, None])[:, None, None]
    got = reference.sdpa(query, keys, values, mask, 0.125)
    eager_mask = torch.ones(batch, 1, 1, length, dtype=torch.bool) if mask is None else mask
    expected, _ = reference.eager_attention(query.float(), keys.float(), values.float(), eager_mask, 0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    if dtype != torch.float32:
        native = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.125,
                                                                  enable_gqa=True)
        assert torch.equal(got, native)
    if masked:
        assert (got[2] == 0).all()


def test_engine_on_the_triton_backend_equals_generate_alone():
    """The engine's packed forwards (decodes of several sequences in one `paged_decode`, prefill
    chunks each in its own `paged_prefill`) on the kernels: each request's greedy tokens equal
    `generate` with DynamicCache for that request alone."""
    from conftest import VOCAB
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    import hf_paged_kv
    from hf_paged_kv import Engine, KVPool

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None,
                         initializer_range=0.3)  # head dim 64, a kernel variant; sharp attention
    model = LlamaForCausalLM(config).eval().to(DEVICE)
    gen = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 37, 20)]

    def alone(prompt):
        ids = torch.tensor([prompt], device=DEVICE)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(),
                             max_new_tokens=6, do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    expected = [alone(p) for p in batch]
    engine = Engine(model, pool=KVPool(num_blocks=32, block_size=16), backend="triton", max_batch_tokens=24,
                    controller=False)
    try:
        with engine:
            handles = [engine.submit(p, max_new_tokens=6) for p in batch]
            assert [h.result(timeout=300) for h in handles] == expected
        assert engine.backend.name == "triton" and engine.stats()["max_running"] >= 2
    finally:
        hf_paged_kv.disable(model)


def test_a_decode_layer_costs_the_host_two_launches_and_few_operators(monkeypatch):
    """On a GPU a decode step of a small model is bound by the host's work per layer (the H200
    run: 0.68-0.73x DynamicCache). Per layer the Triton backend launches the KV write and one
    decode kernel (rows this short take one split) and dispatches at most a few torch operators
    more than DynamicCache does; what the layers share is built once per forward."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    import hf_paged_kv
    from hf_paged_kv import KVPool, PagedCache
    from hf_paged_kv.kernels import triton_utils

    class Count(TorchDispatchMode):
        """Operators dispatched outside kernel launches (the interpreter's own work is not counted)."""

        def __init__(self):
            super().__init__()
            self.operators, self.launches, self.in_launch = 0, 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.operators += not self.in_launch
            return func(*args, **(kwargs or {}))

    counter = Count()
    launch = triton_utils.Launch.run

    def counted_launch(self):
        counter.launches += 1
        counter.in_launch = True
        try:
            launch(self)
        finally:
            counter.in_launch = False

    monkeypatch.setattr(triton_utils.Launch, "run", counted_launch)

    def decode_step(layers: int, paged: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                                             num_attention_heads=4, num_key_value_heads=2)).eval().to(DEVICE)
        if paged:
            hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=16), backend="triton")
        ids = torch.randint(3, 96, (2, 40), device=DEVICE)
        with PagedCache() if paged else contextlib.nullcontext(DynamicCache()) as cache, torch.inference_mode():
            model(input_ids=ids, past_key_values=cache)
            step = torch.randint(3, 96, (2, 1), device=DEVICE)
            counter.operators = counter.launches = 0
            with counter:
                model(input_ids=step, past_key_values=cache)
        if paged:
            hf_paged_kv.disable(model)
        return counter.operators, counter.launches

    per_layer = {}
    for paged in (False, True):
        (ops_2, launches_2), (ops_4, launches_4) = decode_step(2, paged), decode_step(4, paged)
        per_layer[paged] = ((ops_4 - ops_2) / 2, (launches_4 - launches_2) / 2)
    assert per_layer[True][1] == 2 and per_layer[False][1] == 0
    assert per_layer[True][0] - per_layer[False][0] <= 4, per_layer
