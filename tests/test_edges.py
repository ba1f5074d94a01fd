"""The edges of the drop-in promise: models that change after `enable`, interrupted forwards,
bad calls refused clearly, tenants, and the semantic index kept out of locks and finalizers."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading

import pytest
import torch
from conftest import VOCAB, assert_pool_clean, greedy, make_model, random_batch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, PagedKVError


def prompt(n, seed):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, cache, new=8):
    return greedy(model, cache, ids, torch.ones_like(ids), new_tokens=new)


# ------------------------------------------------------------ the model changes
def test_new_weights_loaded_in_place_are_never_served_old_kv():
    model, other = make_model("llama", seed=1), make_model("llama", seed=2)
    ids = prompt(40, 3)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=8))
    with PagedCache() as cache:
        generate(model, ids, cache)  # the prefix is cached for the first weights
    model.load_state_dict(other.state_dict())  # in place: same tensors, other values
    expected = generate(other, ids, DynamicCache())
    with PagedCache() as cache:
        got = generate(model, ids, cache)
        assert cache.inherited == [0]  # the old weights' KV was not inherited
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with PagedCache() as cache:  # and the new weights' KV is reused as usual
        generate(model, ids, cache)
        assert cache.inherited == [32]
    assert_pool_clean(pool)


def test_merged_adapter_changes_the_fingerprint():
    model = make_model("llama", seed=4)
    ids = prompt(40, 5)
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=8))
    with PagedCache() as cache:
        generate(model, ids, cache)
    with torch.no_grad():  # what merging a LoRA adapter does: an in-place update of the weights
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.add_(0.05 * torch.randn_like(layer.self_attn.q_proj.weight))
            layer.self_attn.v_proj.weight.add_(0.05 * torch.randn_like(layer.self_attn.v_proj.weight))
    with PagedCache() as cache:
        got = generate(model, ids, cache)
        assert cache.inherited == [0]
    hf_paged_kv.disable(model)
    torch.testing.assert_close(got, generate(model, ids, DynamicCache()), rtol=0, atol=0)


def test_changed_dtype_is_refused_clearly():
    model = make_model("llama", seed=6)
    hf_paged_kv.enable(model)
    model.to(torch.bfloat16)
    with pytest.raises(PagedKVError, match="dtype or device changed after hf_paged_kv.enable"):
        generate(model, prompt(10, 7), PagedCache())
    hf_paged_kv.disable(model)


def test_two_models_sharing_a_pool_keep_their_kv_apart():
    first, second = make_model("llama", seed=8), make_model("llama", seed=9)
    ids = prompt(40, 10)
    pool = hf_paged_kv.enable(first, pool=KVPool(num_blocks=64, block_size=8))
    hf_paged_kv.enable(second, pool=pool)
    with PagedCache() as cache:
        generate(first, ids, cache)
    with PagedCache() as cache:
        got = generate(second, ids, cache)
        assert cache.inherited == [0]  # same prompt, other weights: nothing shared
    with PagedCache() as cache:
        generate(first, ids, cache)
        assert cache.inherited == [32]
    hf_paged_kv.disable(first), hf_paged_kv.disable(second)
    torch.testing.assert_close(got, generate(second, ids, DynamicCache()), rtol=0, atol=0)
    assert_pool_clean(pool)


# ------------------------------------------------------- interrupted forwards
@pytest.mark.parametrize("interruption", [KeyboardInterrupt, SystemExit, GeneratorExit, RuntimeError])
def test_any_interruption_undoes_the_forward(interruption):
    model = make_model("llama", seed=11)
    ids = prompt(30, 12)
    expected = generate(model, ids, DynamicCache(), new=6)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=8))
    calls = [0]

    def interrupt(module, args):
        calls[0] += 1
        if calls[0] == 3:  # the second layer of the second decode step
            raise interruption("interrupted")

    handle = model.model.layers[1].register_forward_pre_hook(interrupt)
    cache = PagedCache()
    with pytest.raises(interruption):
        generate(model, ids, cache, new=6)
    handle.remove()
    assert cache.row_lengths() == [31] and cache.get_seq_length() == 31  # the interrupted step left no trace
    # continuing the same cache gives what an uninterrupted run gives
    resumed = model.generate(input_ids=expected[:, :32], attention_mask=torch.ones(1, 32, dtype=torch.long),
                             past_key_values=cache, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(resumed, expected, rtol=0, atol=0)
    cache.release()
    assert_pool_clean(pool)


@pytest.fixture
def semantic_setup():
    from test_semantic import DOCUMENT, encode
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_paged_kv import SemanticIndex
    from hf_paged_kv.reuse.semantic import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                         initializer_range=0.3)
    model = LlamaForCausalLM(config).eval()
    semantic = SemanticIndex(tokenizer, threshold=0.5)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=16, semantic=semantic))
    yield model, pool, encode(tokenizer, DOCUMENT + " What did he carry?"), semantic
    hf_paged_kv.disable(model)


def test_interrupted_prompt_is_never_offered_to_the_semantic_index(semantic_setup):
    model, pool, ids, semantic = semantic_setup
    handle = model.model.layers[1].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(KeyboardInterrupt()))
    cache = PagedCache()
    with pytest.raises(KeyboardInterrupt):
        generate(model, ids, cache)
    handle.remove()
    cache.release()
    assert len(semantic) == 0  # nothing half-written was offered
    assert pool.stats()["blocks_cached"] == 0  # nor indexed
    expected = generate(model, ids, DynamicCache())
    with PagedCache() as cache:
        got = generate(model, ids, cache)
        assert cache.inherited == [0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_embedding_runs_outside_the_pool_lock_and_never_in_a_finalizer(semantic_setup):
    model, pool, ids, semantic = semantic_setup
    embedder = semantic.embedder
    calls = []

    class Watching:
        """Wraps the real embedder: records each call, and checks that another thread can use
        the pool meanwhile (it could not if the caller held the pool's lock)."""

        def encode(self, *args, **kwargs):
            other = threading.Thread(target=pool.stats)
            other.start()
            other.join(timeout=5)
            calls.append(("collecting" if gc.isenabled() and in_gc[0] else "normal", not other.is_alive()))
            return embedder.encode(*args, **kwargs)

    in_gc = [False]
    gc.callbacks.append(lambda phase, info: in_gc.__setitem__(0, phase == "start"))
    semantic.embedder_source = Watching()
    try:
        generate(model, ids, PagedCache())  # never released: the garbage collector frees it
        gc.collect()
        before = len(calls)
        assert all(kind == "normal" for kind, _ in calls)  # no embedding ran inside garbage collection
        generate(model, ids, PagedCache(reuse=True))  # the next request embeds what was queued
        gc.collect()
        assert len(calls) > before and all(free for _, free in calls)  # and never under the pool's lock
    finally:
        gc.callbacks.pop()


# ----------------------------------------------------------- refused clearly
def test_use_cache_false_with_a_paged_cache_is_refused(llama):
    hf_paged_kv.enable(llama)
    with pytest.raises(PagedKVError, match="use_cache=False"):
        ids, mask = random_batch(1, 8)
        llama.generate(input_ids=ids, attention_mask=mask, past_key_values=PagedCache(), use_cache=False,
                       max_new_tokens=3)


def test_empty_prefix_cannot_be_pinned(llama):
    hf_paged_kv.enable(llama)
    with pytest.raises(ValueError, match="empty"):
        hf_paged_kv.pin(llama, [])


def test_disk_budget_below_one_block_is_refused(llama, tmp_path):
    with pytest.raises(ValueError, match="cannot hold one block file"):
        hf_paged_kv.enable(llama, pool=KVPool(num_blocks=8, disk_dir=tmp_path, disk_bytes=1000))


def test_generate_without_input_ids_when_bos_is_the_pad_token():
    """GPT-2's tester: generate() builds the prompt from BOS, which is also the pad token, so the
    only prompt token is masked out: a row with no stored token at all."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                                       pad_token_id=0, eos_token_id=2, initializer_range=0.3)).eval()
    expected = model.generate(max_new_tokens=6, do_sample=False)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=16, block_size=4))
    with PagedCache() as cache:
        got = model.generate(past_key_values=cache, max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


def test_pad_further_back_than_the_window_sees_nothing_as_with_sdpa():
    """A right-padded row padded further than the sliding window: its last (pad) query sees no
    key at all. transformers' sdpa gives it zeros, and so does hf_paged_kv."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=6, pad_token_id=0, initializer_range=0.3)).eval()
    ids = prompt(20, 13)
    mask = torch.ones_like(ids)
    mask[:, 9:] = 0  # 11 pads > the window of 6
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=4))
    with PagedCache() as cache:
        got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                             do_sample=False)
    hf_paged_kv.disable(model)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ------------------------------------------------------------------- tenants
def test_clear_tenant_reaches_every_tier(tmp_path):
    model = make_model("llama", seed=14)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=8, host_blocks=4, disk_dir=tmp_path))
    ids = prompt(40, 15)
    with PagedCache(tenant="acme") as cache:
        generate(model, ids, cache, new=1)
    pool.decref(pool.allocate(pool.num_available()))  # push it down: 4 blocks to host, the rest to disk
    where = hf_paged_kv.cached_tokens(model, ids, tenant="acme")
    assert where["device"] == 0 and where["host"] + where["disk"] == 40
    pool.clear_tenant("acme")
    assert hf_paged_kv.cached_tokens(model, ids, tenant="acme") == {"device": 0, "host": 0, "disk": 0}
    assert not list(tmp_path.glob("*.kvblock"))
    with PagedCache(tenant="acme") as cache:
        generate(model, ids, cache, new=1)
        assert cache.inherited == [0]
    hf_paged_kv.disable(model)


# --------------------------------------------------------------- pool dtype
def test_a_pool_of_lower_precision_stores_it_and_tracks_full_precision():
    """`KVPool(dtype=bfloat16)` under an fp32 model: KV is stored rounded (half the bytes), the
    prefill and every decode step read what was stored, and the logits stay within a few percent
    of DynamicCache's (bf16 rounding, compounded over the layers)."""
    model = make_model("llama", seed=5)
    ids = prompt(37, 6)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=16, block_size=8, dtype=torch.bfloat16))
    assert all(cache.dtype == torch.bfloat16 for cache in pool.key_cache + pool.value_cache)
    steps = [ids, torch.tensor([[7]]), torch.tensor([[11]])]
    logits = {}
    for name, cache in (("paged", PagedCache(reuse=False)), ("dynamic", DynamicCache())):
        seen, logits[name] = 0, []
        for chunk in steps:
            seen += chunk.shape[1]
            out = model(input_ids=chunk, attention_mask=torch.ones(1, seen, dtype=torch.long), past_key_values=cache,
                        position_ids=torch.arange(seen - chunk.shape[1], seen)[None])
            logits[name].append(out.logits[0, -1])
        if name == "paged":
            cache.release()
    for paged, dynamic in zip(logits["paged"], logits["dynamic"]):
        assert not torch.equal(paged, dynamic)  # the rounded KV is what attention read
        assert (paged - dynamic).abs().max() <= 0.03 * dynamic.abs().max()  # measured: 1.2%
        assert paged.argmax() == dynamic.argmax()
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


# ------------------------------------------------------------ gradients and threads
def test_a_forward_with_gradients_on_leaves_no_graph_in_the_pool(llama):
    """The pool outlives every forward: K/V stored with their autograd graph would keep each
    grad-enabled forward's activations alive and break the next backward."""
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32, block_size=8))
    ids = prompt(12, 5)
    for _ in range(3):
        with PagedCache(reuse=False) as cache:
            llama(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache).logits.sum().backward()
    assert not any(t.requires_grad for t in pool.key_cache + pool.value_cache)
    llama.zero_grad()


def test_one_cache_in_two_threads_at_once_is_refused(llama):
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32, block_size=8))
    ids = prompt(12, 6)
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold(*_):
        inside.set()
        release.wait(30)

    hook = llama.model.layers[0].register_forward_pre_hook(hold)
    with PagedCache() as cache:
        first = threading.Thread(target=lambda: llama(input_ids=ids, past_key_values=cache))
        first.start()
        assert inside.wait(30)
        hook.remove()
        try:
            llama(input_ids=ids, past_key_values=cache)
        except PagedKVError as error:
            errors.append(str(error))
        release.set()
        first.join(30)
        assert errors and "in a forward on another thread" in errors[0]
        assert cache.row_lengths() == [12]  # the first thread's forward went through untouched

@contextlib.contextmanager
def racing(model):
    """Yields `race(calls)`: start the calls on threads at once, with thread switches forced every
    microsecond; each is held in its forward's first layer (or refused) until all are, then let
    go. `race` returns the refusals."""
    inside, release, armed = threading.Semaphore(0), threading.Event(), threading.Event()

    def hold(*_):
        if armed.is_set():
            inside.release()
            release.wait(30)

    def race(calls) -> list[PagedKVError]:
        start, errors = threading.Barrier(len(calls)), []

        def run(call):
            start.wait(30)
            try:
                call()
            except PagedKVError as error:
                errors.append(error)
                inside.release()

        threads = [threading.Thread(target=run, args=(call,)) for call in calls]
        release.clear()
        armed.set()
        for thread in threads:
            thread.start()
        assert all(inside.acquire(timeout=30) for _ in calls)
        armed.clear()
        release.set()
        for thread in threads:
            thread.join(30)
        return errors

    hook = model.model.layers[0].register_forward_pre_hook(hold)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield race
    finally:
        sys.setswitchinterval(interval)
        hook.remove()


def test_two_threads_starting_a_forward_on_one_cache_at_once_cannot_both_pass(llama):
    """The check that the cache is free and its claim are one step: two threads that start
    together never both plan a forward on it."""
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64, block_size=8))
    ids = prompt(12, 7)
    with racing(llama) as race:
        for _ in range(50):
            with PagedCache() as cache:
                errors = race([lambda: llama(input_ids=ids, past_key_values=cache)] * 2)
                assert len(errors) == 1 and "in a forward on another thread" in str(errors[0])
                assert cache.row_lengths() == [12]


def test_a_thread_that_loses_the_race_for_a_cache_leaves_its_rows_untouched(llama):
    """The claim comes before anything reads or changes the rows: two threads starting a turn
    whose masks each hide another stored token leave the cache with the winner's change only
    (the loser used to drop its token before it lost)."""
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=64, block_size=8))
    ids, new = prompt(12, 8), prompt(1, 9)
    masks = [torch.ones(1, 13, dtype=torch.long) for _ in range(2)]
    masks[0][0, 3] = masks[1][0, 5] = 0
    with racing(llama) as race:
        for _ in range(20):
            with PagedCache() as cache:
                llama(input_ids=ids, past_key_values=cache)
                errors = race([lambda m=m: llama(input_ids=new, attention_mask=m, past_key_values=cache) for m in masks])
                assert len(errors) == 1 and "in a forward on another thread" in str(errors[0])
                assert cache.row_lengths() == [12]  # 12 stored, one hidden by the winner, its new token
