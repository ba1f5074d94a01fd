"""Every documented failure raises the project's error with a message that says what to do."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_pool_clean, greedy, make_model, random_batch
from transformers import DynamicCache, T5Config, T5ForConditionalGeneration

import hf_paged_kv
from hf_paged_kv import (
    CacheReleasedError,
    KVPool,
    NotEnabledError,
    PagedCache,
    PagedKVError,
    PoolExhaustedError,
    UnsupportedModelError,
)
from hf_paged_kv.engine import SLO, Limits


def test_pool_exhausted_is_clean_and_recoverable(llama):
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=6, block_size=8))
    ids, mask = random_batch(2, 30, max_pad=0)  # 2 x 4 blocks of prompt: more than 6
    before = pool.stats()
    with pytest.raises(PoolExhaustedError, match=r"needs 8 more block\(s\) but only 6 of 6 are free or evictable") as info:
        greedy(llama, PagedCache(), ids, mask)
    assert (info.value.needed, info.value.free) == (8, 6)
    assert pool.stats()["blocks_free"] == before["blocks_free"]
    assert_pool_clean(pool)
    # the pool is intact: a request that fits works and matches DynamicCache
    small_ids, small_mask = ids[:1, :20], mask[:1, :20]
    with PagedCache() as cache:
        got = greedy(llama, cache, small_ids, small_mask, new_tokens=10)
    torch.testing.assert_close(got, greedy(llama, DynamicCache(), small_ids, small_mask, new_tokens=10))
    assert_pool_clean(pool)


def test_pool_exhausted_during_decode_keeps_what_was_generated(llama):
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=3, block_size=8))
    ids, mask = random_batch(1, 20)
    cache = PagedCache()
    with pytest.raises(PoolExhaustedError):
        greedy(llama, cache, ids, mask, new_tokens=10)  # needs a 4th block at token 25
    assert cache.row_lengths() == [24] and cache.get_seq_length() == 24
    assert pool.stats()["blocks_used"] == 3
    cache.release()
    assert_pool_clean(pool)


def test_cache_on_a_model_that_was_not_enabled():
    model = make_model("llama")
    ids, mask = random_batch(1, 10)
    with pytest.raises(NotEnabledError, match=r"hf_paged_kv.enable\(model\)"):
        greedy(model, PagedCache(), ids, mask)


def test_released_cache_cannot_be_reused(llama):
    hf_paged_kv.enable(llama)
    ids, mask = random_batch(1, 10)
    cache = PagedCache()
    greedy(llama, cache, ids, mask)
    cache.release()
    cache.release()  # idempotent
    with pytest.raises(CacheReleasedError, match="create a new PagedCache"):
        greedy(llama, cache, ids, mask)


def test_cache_cannot_move_between_models(llama):
    other = make_model("llama", seed=1)
    hf_paged_kv.enable(llama)
    hf_paged_kv.enable(other)
    ids, mask = random_batch(1, 10)
    with PagedCache() as cache:
        greedy(llama, cache, ids, mask)
        with pytest.raises(PagedKVError, match="belongs to another pool than the model's"):
            greedy(other, cache, ids, mask)
    hf_paged_kv.disable(other)


def test_batch_size_cannot_change_within_a_cache(llama):
    hf_paged_kv.enable(llama)
    with PagedCache() as cache:
        greedy(llama, cache, *random_batch(2, 10))
        with pytest.raises(PagedKVError, match="batch size changed from 2 to 3"):
            greedy(llama, cache, *random_batch(3, 30))


def test_enable_is_idempotent_and_disable_restores(llama):
    pool = hf_paged_kv.enable(llama, backend="torch")
    assert hf_paged_kv.enable(llama) is pool
    assert hf_paged_kv.pool_of(llama) is pool
    with pytest.raises(PagedKVError, match="already enabled with another pool"):
        hf_paged_kv.enable(llama, pool=KVPool(num_blocks=4))
    hf_paged_kv.disable(llama)
    assert llama.config._attn_implementation == "sdpa"
    with pytest.raises(PagedKVError, match="not enabled"):
        hf_paged_kv.pool_of(llama)
    with pytest.raises(NotEnabledError):
        greedy(llama, PagedCache(), *random_batch(1, 5))


def test_unsupported_models_are_refused_at_enable():
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16))
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        hf_paged_kv.enable(t5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_blocks=0), "num_blocks must be an int >= 1"),
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(max_bytes=-5), "max_bytes must be >= 1"),
        (dict(memory_fraction=1.5), r"memory_fraction must be in \(0, 1\]"),
        (dict(num_blocks=4, max_bytes=100), "at most one of"),
        (dict(ttl=float("nan")), "ttl must be a finite number of seconds > 0"),
        (dict(half_life=0), "half_life must be a finite number of seconds > 0"),
    ],
)
def test_bad_pool_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVPool(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_batch_tokens=0), r"Limits.max_batch_tokens must be >= 1"),
        (dict(max_running=0), r"Limits.max_running must be >= 1"),
        (dict(max_waiting=0), r"Limits.max_waiting must be >= 1"),
        (dict(burst_batch_tokens=0), r"Limits.burst_batch_tokens must be >= 1"),
        (dict(growth_ratio_decay=-1.0), r"Limits.growth_ratio_decay must be >= 0"),
        (dict(watermark=1.5), r"Limits.watermark is a fraction in \[0, 1\]"),
        (dict(growth_ratio_min=-0.1), r"Limits.growth_ratio_min is a fraction"),
        (dict(ttft_target=0.0), r"Limits.ttft_target must be a finite number of seconds > 0"),
        (dict(ttft_target=math.inf), r"Limits.ttft_target must be a finite number of seconds > 0"),
        (dict(ttft_target=math.nan), r"Limits.ttft_target must be a finite number of seconds > 0"),
        (dict(per_token_target=-1.0), r"Limits.per_token_target must be a finite number of seconds > 0"),
        (dict(per_token_target=math.inf), r"Limits.per_token_target must be a finite number of seconds > 0"),
        (dict(max_batch_tokens=256, burst_batch_tokens=200), r"burst_batch_tokens .* at least max_batch_tokens \(256\)"),
    ],
)
def test_bad_engine_limits(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Limits(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(ttft=0.0), dict(per_token=-1.0), dict(ttft=math.inf), dict(per_token=math.nan)])
def test_bad_service_level_targets(kwargs):
    with pytest.raises(ValueError, match="SLO targets must be finite numbers of seconds > 0"):
        SLO(**kwargs)


def test_a_byte_budget_may_be_written_as_a_float(llama):
    pool = hf_paged_kv.enable(llama, pool=KVPool(max_bytes=1e6))
    assert 0 < pool.stats()["bytes_total"] <= 1e6
    hf_paged_kv.disable(llama)


def test_budget_too_small_for_one_block(llama):
    with pytest.raises(ValueError, match="max_bytes=100 holds no block"):
        hf_paged_kv.enable(llama, pool=KVPool(max_bytes=100))


def test_bad_backend_name(llama):
    with pytest.raises(ValueError, match="backend must be one of"):
        hf_paged_kv.enable(llama, backend="cuda-magic")


def test_training_dropout_is_refused(llama):
    hf_paged_kv.enable(llama)
    for layer in llama.model.layers:
        layer.self_attn.attention_dropout = 0.1
    llama.train()
    with pytest.raises(PagedKVError, match="dropout must be 0"):
        llama(*random_batch(1, 5), past_key_values=PagedCache())


@pytest.mark.parametrize("priority", ["high", None, 1.5, True, -10**400, 1_000_001])
def test_a_bad_priority_is_refused_where_it_is_given(llama, priority):
    """Stored on cached blocks, it broke every later eviction of every request on the pool; a
    huge one failed the engine's step once the load controller shed by it (a float gauge)."""
    from hf_paged_kv import Engine

    message = "priority must be within" if isinstance(priority, int) and not isinstance(priority, bool) else \
        "priority must be an integer"
    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32, block_size=8))
    with pytest.raises(ValueError, match=message):
        PagedCache(priority=priority)
    with pytest.raises(ValueError, match=message):
        hf_paged_kv.pin(llama, torch.arange(3, 19), priority=priority)
    engine = Engine(llama, pool=pool)
    with engine, pytest.raises(ValueError, match=message):
        engine.submit([5, 6, 7], max_new_tokens=2, priority=priority)
    assert engine.stats()["requests_failed"] == 0
    assert_pool_clean(pool)


@pytest.mark.parametrize("tenant", ["", None, 7, "bob\ud83d"])
def test_a_bad_tenant_is_refused_where_it_is_given(llama, tenant):
    """A lone surrogate (JSON allows one) cannot be hashed into a block digest: it failed the
    engine's step, and every request in it."""
    from hf_paged_kv import Engine

    pool = hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32, block_size=8))
    with pytest.raises(ValueError, match="tenant must be"):
        PagedCache(tenant=tenant)
    engine = Engine(llama, pool=pool)
    with engine:
        with pytest.raises(ValueError, match="tenant must be"):
            engine.submit([5, 6, 7], max_new_tokens=2, tenant=tenant)
        assert len(engine.submit([5, 6, 7], max_new_tokens=2).result(timeout=60)) == 2
    assert engine.stats()["requests_failed"] == 0
    assert_pool_clean(pool)


@pytest.mark.parametrize("ttl", [-5, 0, float("inf"), "10"])
def test_a_bad_ttl_is_refused(llama, ttl):
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32, block_size=8))
    with pytest.raises(ValueError, match="ttl must be a finite number of seconds > 0"):
        hf_paged_kv.pin(llama, torch.arange(3, 19), ttl=ttl)
    with pytest.raises(ValueError, match="ttl must be a finite number of seconds > 0"):
        hf_paged_kv.SemanticIndex(tokenizer=None, ttl=ttl)


def test_a_batch_given_as_one_prefix_is_refused(llama):
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32, block_size=8))
    with pytest.raises(ValueError, match=r"one sequence of token ids, got a tensor of shape \(2, 8\)"):
        hf_paged_kv.cached_tokens(llama, torch.arange(3, 19).reshape(2, 8))
    assert hf_paged_kv.cached_tokens(llama, torch.arange(3, 19)[None]) == {"device": 0, "host": 0, "disk": 0}


def test_the_triton_backend_is_refused_for_layers_off_cuda(llama, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(PagedKVError, match="runs its kernels on CUDA devices, and the model has layers on cpu"):
        hf_paged_kv.enable(llama, backend="triton")
    with pytest.raises(NotEnabledError):  # refused before anything changed
        hf_paged_kv.pool_of(llama)


def test_a_cache_given_another_pool_says_so(llama):
    hf_paged_kv.enable(llama, pool=KVPool(num_blocks=32, block_size=8))
    with pytest.raises(PagedKVError, match="belongs to another pool than the model's"):
        llama(*random_batch(1, 5), past_key_values=PagedCache(pool=KVPool(num_blocks=8)))


def test_the_configuration_classes_are_at_the_top_level():
    from hf_paged_kv import SLO, Limits, RequestFailed, Thresholds  # noqa: F401 - the README imports them so


def test_a_pool_before_enable_says_it_has_no_blocks_yet():
    pool = KVPool(num_blocks=8)
    assert pool.stats() == {"block_size": 16, "num_blocks": 0} and "unbound" in repr(pool)
    for call in (pool.audit, lambda: pool.clear_tenant("a"), lambda: pool.make_free(1), pool.num_available):
        with pytest.raises(PagedKVError, match="no blocks yet: hf_paged_kv.enable"):
            call()
