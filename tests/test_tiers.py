"""Host tier: cold cached blocks are demoted instead of dropped, and come back bit-exact."""

from __future__ import annotations

import collections
import time

import pytest
import torch
from conftest import VOCAB, assert_pool_clean, greedy, make_model, manual_clock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache
from hf_paged_kv.integration.hooks import current_fingerprint

BLOCK = 8


def tokens(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=51)


@pytest.fixture(autouse=True)
def disabled(model):
    yield
    hf_paged_kv.disable(model)


def request(model, prompt, new_tokens=4, blocks=0, **options):
    """Generate for one prompt (`options`: PagedCache's); returns the tokens it inherited, its
    output (and with `blocks`, the ids of its first blocks, read while the cache was alive)."""
    with PagedCache(**options) as cache:
        out = greedy(model, cache, prompt[None], torch.ones(1, len(prompt), dtype=torch.long), new_tokens=new_tokens)
        held = cache.block_tables()[0][:blocks]
        inherited = cache.inherited[0]
    return (inherited, out, held) if blocks else (inherited, out)


def block_file(directory, depth):
    """The disk tier's file of the block at `depth` (read from the documented safetensors metadata)."""
    from safetensors import safe_open

    for path in directory.glob("*.kvblock"):
        with safe_open(str(path), framework="pt") as f:
            if f.metadata()["depth"] == str(depth):
                return path
    raise FileNotFoundError(depth)


def dir_bytes(directory):
    return sum(p.stat().st_size for p in directory.glob("*.kvblock"))


def evict_all(pool):
    """Every cached block leaves the device (to the next tier down)."""
    pool.decref(pool.allocate(pool.num_available()))


def file_size(model, directory):
    """The size of one block file (then deleted), to size disk budgets in files."""
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=directory))
    hf_paged_kv.persist(model, tokens(8, 99))
    (path,) = directory.glob("*.kvblock")
    size = path.stat().st_size
    path.unlink()
    hf_paged_kv.disable(model)
    return size


def snapshot(pool, blocks):
    return [torch.stack([c[b].clone() for c in pool.key_cache + pool.value_cache]) for b in blocks]


def test_demoted_blocks_come_back_bit_exact(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, host_blocks=16))
    system = tokens(40, 1)
    _, _, blocks = request(model, system, blocks=5)
    before = snapshot(pool, blocks)
    taken = pool.allocate(pool.num_available())  # pressure: every cached block leaves the device
    assert hf_paged_kv.cached_tokens(model, system) == {"device": 0, "host": 40, "disk": 0}
    pool.decref(taken)
    prompt = torch.cat([system, tokens(6, 2)])
    skipped, out, promoted = request(model, prompt, blocks=5)
    assert skipped == 40
    for now, original in zip(snapshot(pool, promoted), before):  # device -> host -> device is bit-exact
        assert torch.equal(now, original)
    hf_paged_kv.disable(model)
    expected = greedy(model, DynamicCache(), prompt[None], torch.ones(1, 46, dtype=torch.long), new_tokens=4)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    stats = pool.stats()
    assert stats["promotions"] == 5 and stats["demotions"] >= 5 and stats["copy_bytes"] > 0
    assert stats["hit_tokens_host"] == 40
    assert_pool_clean(pool)


def test_without_a_host_tier_evicted_blocks_are_recomputed(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK))
    system = tokens(40, 1)
    request(model, system)
    pool.decref(pool.allocate(pool.num_available()))
    assert request(model, torch.cat([system, tokens(6, 2)]))[0] == 0
    assert "promotions" not in pool.stats()


def test_pinned_blocks_are_never_demoted(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, host_blocks=16, pin_budget=0.5))
    pin = hf_paged_kv.pin(model, tokens(40, 3))
    request(model, tokens(40, 4))
    pool.decref(pool.allocate(pool.num_available()))
    assert hf_paged_kv.cached_tokens(model, tokens(40, 3)) == {"device": 40, "host": 0, "disk": 0}
    assert hf_paged_kv.cached_tokens(model, tokens(40, 4))["host"] == 40  # the unpinned one was demoted
    hf_paged_kv.unpin(model, pin)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30)), min_size=1, max_size=6))
def test_tier_budgets_hold_under_random_workloads(model, workload):
    hf_paged_kv.disable(model)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=20, block_size=BLOCK, host_blocks=6))
    prefixes = [tokens(24 + 8 * i, 100 + i) for i in range(6)]
    for which, extra in workload:
        prompt = torch.cat([prefixes[which], tokens(extra, 200 + extra)])
        skipped, out = request(model, prompt, new_tokens=2)
        expected = greedy(model, DynamicCache(), prompt[None], torch.ones(1, len(prompt), dtype=torch.long), new_tokens=2)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)  # whatever tier the prefix came from
        stats = pool.stats()
        assert stats["host_blocks_used"] <= 6
        assert stats["blocks_free"] + stats["blocks_cached"] + stats["blocks_used"] == 20
        assert skipped % BLOCK == 0 and skipped < len(prompt)
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


def test_disk_round_trip_is_bit_exact(model, tmp_path):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    system = tokens(40, 5)
    _, _, blocks = request(model, system, blocks=5)
    before = snapshot(pool, blocks)
    pool.decref(pool.allocate(pool.num_available()))  # no host tier: device -> disk
    assert len(list(tmp_path.glob("*.kvblock"))) >= 5
    skipped, _, promoted = request(model, torch.cat([system, tokens(6, 6)]), blocks=5)
    assert skipped == 40
    for now, original in zip(snapshot(pool, promoted), before):
        assert torch.equal(now, original)
    assert pool.stats()["disk_hits"] == 5 and pool.stats()["hit_tokens_disk"] == 40


def test_restarted_process_reuses_persisted_prefix(tmp_path):
    first = make_model("llama", seed=61)
    system = tokens(40, 7)
    hf_paged_kv.enable(first, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    assert hf_paged_kv.persist(first, system) == 40
    # a "new process": a fresh model object with the same weights and a fresh pool on the same directory
    restarted = make_model("llama", seed=61)
    pool = hf_paged_kv.enable(restarted, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    assert pool.stats()["disk_blocks"] == 5
    prompt = torch.cat([system, tokens(6, 8)])
    skipped, out = request(restarted, prompt)
    assert skipped == 40 and pool.stats()["disk_hits"] == 5
    hf_paged_kv.disable(restarted)
    expected = greedy(restarted, DynamicCache(), prompt[None], torch.ones(1, 46, dtype=torch.long), new_tokens=4)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:hf_paged_kv disk tier")  # each pool first sees the other model's files
def test_a_pool_shared_by_two_models_serves_each_its_disk_files_after_a_restart(tmp_path):
    """The directory is read when the first model binds the pool: the second model's files,
    rejected then as another model's, are served once it binds too."""
    systems = {61: tokens(24, 7), 64: tokens(24, 8)}
    first = {seed: make_model("llama", seed=seed) for seed in systems}
    shared = KVPool(num_blocks=48, block_size=BLOCK, disk_dir=tmp_path)
    for seed, model in first.items():
        hf_paged_kv.enable(model, pool=shared)
        assert hf_paged_kv.persist(model, systems[seed]) == 24
    restarted = {seed: make_model("llama", seed=seed) for seed in systems}
    pool = KVPool(num_blocks=48, block_size=BLOCK, disk_dir=tmp_path)
    for model in restarted.values():
        hf_paged_kv.enable(model, pool=pool)
    assert pool.stats()["disk_blocks"] == 6
    for seed, model in restarted.items():
        prompt = torch.cat([systems[seed], tokens(6, 9)])
        skipped, out = request(model, prompt)
        assert skipped == 24
        expected = greedy(make_model("llama", seed=seed), DynamicCache(), prompt[None], torch.ones(1, 30, dtype=torch.long),
                          new_tokens=4)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert pool.stats()["disk_hits"] == 6


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_or_foreign_disk_files_are_rejected(tmp_path, damage):
    writer = make_model("llama", seed=62)
    system = tokens(40, 9)
    hf_paged_kv.enable(writer, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    hf_paged_kv.persist(writer, system)
    victim = block_file(tmp_path, depth=2)  # the third block of the prefix
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-100] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    reader = make_model("llama", seed=63 if damage == "foreign" else 62)  # foreign: other weights
    with pytest.warns(UserWarning, match="hf_paged_kv disk tier: ignoring"):
        pool = hf_paged_kv.enable(reader, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
        prompt = torch.cat([system, tokens(6, 10)])
        skipped, out = request(reader, prompt)
    assert skipped == (0 if damage == "foreign" else 16)  # never past the bad block
    assert pool.stats()["disk_rejects"] >= 1
    assert pool.stats()["disk_bytes_used"] == dir_bytes(tmp_path)  # what it cannot use stays in the budget
    hf_paged_kv.disable(reader)
    expected = greedy(reader, DynamicCache(), prompt[None], torch.ones(1, 46, dtype=torch.long), new_tokens=4)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    hf_paged_kv.disable(writer)


def test_rejected_files_of_a_directory_are_reported_in_one_warning(tmp_path):
    """Files of an earlier format or another model can number thousands: one warning names the
    count and the reasons, every file is counted and budgeted, none is loaded."""
    import warnings

    from safetensors.torch import save_file

    writer = make_model("llama", seed=64)
    hf_paged_kv.enable(writer, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    hf_paged_kv.persist(writer, tokens(40, 11))  # five files of another model, for the reader
    hf_paged_kv.disable(writer)
    for i in range(3):  # an earlier format: no parent field
        save_file({"k.0": torch.zeros(1)}, tmp_path / f"{i:064x}.kvblock", metadata={"format": "hf_paged_kv-block/2"})
    reader = make_model("llama", seed=65)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = hf_paged_kv.enable(reader, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    disk = [str(w.message) for w in caught if "disk tier" in str(w.message)]
    assert len(disk) == 1, disk
    assert "ignoring 8 block files" in disk[0]
    assert "5 written by another model" in disk[0] and "3 not a block file of this format" in disk[0]
    stats = pool.stats()
    assert stats["disk_rejects"] == 8 and stats["disk_blocks"] == 0
    assert stats["disk_bytes_used"] == dir_bytes(tmp_path)
    hf_paged_kv.disable(reader)


def test_disk_budget_holds(model, tmp_path):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    budget = 7 * sum(c[0].nbytes for c in pool.key_cache + pool.value_cache)  # about 6 block files
    hf_paged_kv.disable(model)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path, disk_bytes=budget))
    for seed in range(11, 15):
        hf_paged_kv.persist(model, tokens(40, seed))
        assert pool.stats()["disk_bytes_used"] <= budget
    stats = pool.stats()
    assert stats["disk_drops"] > 0 and stats["disk_bytes_used"] <= budget
    assert len(list(tmp_path.glob("*.kvblock"))) == stats["disk_blocks"]


def test_a_full_host_tier_drops_leaves_not_the_root_of_a_prefix(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, host_blocks=4))
    system = tokens(40, 1)
    request(model, system)
    evict_all(pool)  # five blocks into four slots: the last block goes, its prefix stays reachable
    assert hf_paged_kv.cached_tokens(model, system) == {"device": 0, "host": 32, "disk": 0}
    assert pool.stats()["host_drops"] == 1
    assert request(model, torch.cat([system, tokens(6, 2)]))[0] == 32
    assert_pool_clean(pool)


def test_a_full_host_tier_drops_a_cold_leaf_beside_a_deeper_unrelated_prefix(model):
    """Each block names its parent, so a one-block prefix is a leaf even while another prefix
    has a block one deeper: the cold one goes, not the hot prefix's end."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, host_blocks=3))
    clock = manual_clock(pool)
    cold, hot, late = tokens(8, 21), tokens(16, 22), tokens(8, 23)
    request(model, cold)  # one full block (8 prompt + 4 generated tokens)
    clock[0] = 1200.0  # two half-lives later
    request(model, hot)  # two full blocks
    evict_all(pool)  # three blocks, three host slots
    request(model, late)
    evict_all(pool)  # a fourth: the lowest-value leaf goes
    assert pool.stats()["host_drops"] == 1
    assert hf_paged_kv.cached_tokens(model, cold) == {"device": 0, "host": 0, "disk": 0}
    assert hf_paged_kv.cached_tokens(model, hot) == {"device": 0, "host": 16, "disk": 0}
    assert hf_paged_kv.cached_tokens(model, late)["host"] == 8
    assert_pool_clean(pool)


def test_a_published_block_continued_by_a_tenant_is_not_a_leaf_on_the_host(model):
    """A tenant's block after a published prefix chains in the tenant's namespace, yet names the
    published block as its parent: that cold parent stays while its continuation is held."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, host_blocks=3))
    clock = manual_clock(pool)
    public = tokens(16, 31)
    hf_paged_kv.publish(model, public)
    clock[0] = 1200.0
    own = torch.cat([public, tokens(8, 32)])
    assert request(model, own, tenant="t")[0] == 16  # inherits the published blocks, indexes its own third
    evict_all(pool)
    request(model, tokens(8, 33), tenant="t")
    evict_all(pool)  # a fourth block: a leaf goes, never the published parent
    assert pool.stats()["host_drops"] == 1
    assert hf_paged_kv.cached_tokens(model, public, tenant="t")["host"] == 16
    assert_pool_clean(pool)


def test_a_block_recomputed_while_held_on_the_host_drops_nothing_there(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, host_blocks=1))
    system = tokens(40, 1)
    request(model, system)
    pool.decref(pool.allocate(pool.num_free() + 1))  # the last block of the prefix goes to the host
    assert hf_paged_kv.cached_tokens(model, system)["host"] == 8
    request(model, system)  # inherits 32 tokens, computes the last block again
    pool.decref(pool.allocate(pool.num_free() + 1))  # it leaves the device again: the host has it
    assert pool.stats()["host_drops"] == 0
    assert hf_paged_kv.cached_tokens(model, system) == {"device": 32, "host": 8, "disk": 0}


def test_the_disk_budget_keeps_a_reachable_prefix(model, tmp_path):
    size = file_size(model, tmp_path)
    budget = 3 * size + size // 2
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path, disk_bytes=budget))
    system = tokens(40, 3)
    hf_paged_kv.persist(model, system)  # five blocks, room for three
    evict_all(pool)  # no host tier: every block goes to disk, deepest first
    assert hf_paged_kv.cached_tokens(model, system) == {"device": 0, "host": 0, "disk": 24}
    assert pool.stats()["disk_bytes_used"] == dir_bytes(tmp_path) <= budget
    assert request(model, torch.cat([system, tokens(6, 4)]))[0] == 24


def test_persist_over_the_disk_budget_keeps_the_prefix_reachable_after_a_restart(model, tmp_path):
    """`persist` writes from the first block; the first the budget cannot keep ends it: each
    later block would make room by dropping its own ancestors, leaving files no lookup reaches."""
    size = file_size(model, tmp_path)
    budget = 2 * size + size // 2
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path, disk_bytes=budget))
    system = tokens(40, 5)  # five blocks, room for two
    assert hf_paged_kv.persist(model, system) == 2 * BLOCK
    hf_paged_kv.disable(model)
    restarted = make_model("llama", seed=51)  # a new process: the same weights, a fresh pool on the directory
    pool = hf_paged_kv.enable(restarted, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path,
                                                     disk_bytes=budget))
    assert pool.stats()["disk_blocks"] == 2
    assert hf_paged_kv.cached_tokens(restarted, system) == {"device": 0, "host": 0, "disk": 2 * BLOCK}
    hf_paged_kv.disable(restarted)


def test_disk_files_expire_like_memory(model, tmp_path):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, ttl=10.0, disk_dir=tmp_path))
    clock = manual_clock(pool)
    system, prompt = tokens(40, 1), torch.cat([tokens(40, 1), tokens(6, 2)])
    request(model, system)  # t=0: expires at t=10
    clock[0] = 1.0
    evict_all(pool)
    clock[0] = 5.0
    assert request(model, prompt)[0] == 40  # from disk, keeping its expiry (not t=15)
    clock[0] = 12.0
    assert hf_paged_kv.cached_tokens(model, system) == {"device": 0, "host": 0, "disk": 0}
    assert request(model, prompt)[0] == 0
    assert pool.stats()["disk_expirations"] >= 1  # the first block found expired (the lookup stops there)
    assert len(list(tmp_path.glob("*.kvblock"))) == pool.stats()["disk_blocks"] < 5


def test_a_restart_with_a_ttl_ignores_older_files(model, tmp_path):
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    hf_paged_kv.persist(model, tokens(40, 1))  # no TTL: no expiry of its own
    hf_paged_kv.disable(model)
    time.sleep(0.2)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, ttl=0.1, disk_dir=tmp_path))
    assert pool.stats()["disk_blocks"] == 0 and pool.stats()["disk_expirations"] == 5
    assert not list(tmp_path.glob("*.kvblock"))


def test_with_a_ttl_the_disk_budget_still_drops_by_value(model, tmp_path):
    size = file_size(model, tmp_path)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path,
                                                 disk_bytes=2 * size + size // 2, ttl=1e6))
    hot, cold, new = tokens(9, 11), tokens(9, 12), tokens(9, 13)  # one full block each
    for prompt, priority in ((hot, 8), (cold, 0), (new, 0)):
        request(model, prompt, priority=priority)
        evict_all(pool)  # to disk; the third one is over the budget
    assert [hf_paged_kv.cached_tokens(model, p)["disk"] for p in (hot, cold, new)] == [BLOCK, 0, BLOCK]


def test_other_models_files_count_in_the_disk_budget_and_go_first(tmp_path):
    writer = make_model("llama", seed=61)
    size = file_size(writer, tmp_path)
    hf_paged_kv.enable(writer, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    for seed in range(3):
        hf_paged_kv.persist(writer, tokens(16, 300 + seed))  # six files
    hf_paged_kv.disable(writer)
    reader, budget = make_model("llama", seed=62), 6 * size
    with pytest.warns(UserWarning, match="written by another model"):
        pool = hf_paged_kv.enable(reader, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path,
                                                      disk_bytes=budget))
    assert pool.stats()["disk_bytes_used"] == dir_bytes(tmp_path)
    for seed in range(3):
        hf_paged_kv.persist(reader, tokens(16, 400 + seed))
        assert pool.stats()["disk_bytes_used"] == dir_bytes(tmp_path) <= budget
    assert pool.stats()["disk_blocks"] == 6  # every foreign file gave way to this model's
    hf_paged_kv.disable(reader)


def test_a_disk_budget_of_one_block_of_tensors_is_never_exceeded(model, tmp_path):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    budget = sum(c[0].nbytes for c in pool.key_cache + pool.value_cache)  # a file also has a header
    hf_paged_kv.disable(model)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path, disk_bytes=budget))
    assert hf_paged_kv.persist(model, tokens(40, 3)) == 0
    stats = pool.stats()
    assert stats["disk_bytes_used"] == dir_bytes(tmp_path) <= budget
    assert stats["disk_blocks"] == 0 and stats["disk_drops"] == 1  # the first block does not fit: persist stops


def test_a_block_reused_since_it_came_back_from_disk_keeps_its_weight_there(model, tmp_path):
    """A block loaded from disk keeps its file; evicted again after heavy reuse, the disk's
    catalogue takes its new weight, so a cold block is dropped before it."""
    size = file_size(model, tmp_path)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=8, block_size=BLOCK, disk_dir=tmp_path,
                                                 disk_bytes=2 * size + 100, half_life=10.0, hot_threshold=None))
    clock, extra = manual_clock(pool), tokens(1, 29)
    hot, cold, new = tokens(BLOCK, 21), tokens(BLOCK, 22), tokens(BLOCK, 23)
    request(model, torch.cat([hot, extra]))
    evict_all(pool)  # the hot block's file is written, with the weight of one use
    clock[0] = 1.0
    assert sum(request(model, torch.cat([hot, extra]))[0] for _ in range(20)) == 20 * BLOCK  # loaded once, reused
    clock[0] = 2.0
    evict_all(pool)  # back to disk: its file is already there
    for moment, prompt in ((3.0, cold), (4.0, new)):
        clock[0] = moment
        request(model, torch.cat([prompt, extra]))
        evict_all(pool)  # over the two-file budget at the third: the coldest goes
    assert hf_paged_kv.cached_tokens(model, hot)["disk"] == BLOCK
    assert hf_paged_kv.cached_tokens(model, cold)["disk"] == 0


def test_half_written_files_left_long_ago_are_removed_at_start(model, tmp_path):
    """A writer that died between writing and renaming left a partial file: removed once it is
    older than any write takes; a recent one may be another process's write in progress."""
    import os
    import time

    from hf_paged_kv.tiers.disk import ABANDONED_AFTER

    old, recent = (tmp_path / f".{c * 64}.kvblock.{pid}.partial" for c, pid in (("a", 11), ("b", 12)))
    for path in (old, recent):
        path.write_bytes(b"torn")
    past = time.time() - ABANDONED_AFTER - 60
    os.utime(old, (past, past))
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=8, block_size=BLOCK, disk_dir=tmp_path))
    assert not old.exists() and recent.exists()


def test_a_restart_with_another_block_size_says_so(model, tmp_path):
    import warnings

    hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=16, disk_dir=tmp_path))
    hf_paged_kv.persist(model, tokens(16, 31))
    hf_paged_kv.disable(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    assert any(f"block_size=16 where this pool has block_size={BLOCK}" in str(w.message) for w in caught)


def test_a_promotion_pushed_from_host_to_disk_by_its_own_allocation_counts_as_a_disk_hit(tmp_path):
    """Promoting a host block takes a device block first, which may demote another block into
    the full host tier and push the wanted one on to disk: it then comes from disk."""
    model = make_model("llama", seed=52)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=4, block_size=BLOCK, host_blocks=1, disk_dir=tmp_path,
                                                 hot_threshold=None))
    prompt = tokens(9, 1)
    request(model, prompt, new_tokens=1)
    seed = 2
    while hf_paged_kv.cached_tokens(model, prompt[:8])["host"] != 8:  # other requests push it to the host tier
        request(model, tokens(9, seed), new_tokens=1)
        seed += 1
    held = pool.allocate(pool.num_free())  # the promotion's block must come from evicting a cached one
    skipped, out = request(model, prompt, new_tokens=1)
    pool.decref(held)
    stats = pool.stats()
    assert skipped == 8 and stats["disk_hits"] == 1
    assert stats["hit_tokens_disk"] == 8 and stats["hit_tokens_host"] == 0
    hf_paged_kv.disable(model)
    expected = greedy(model, DynamicCache(), prompt[None], torch.ones(1, 9, dtype=torch.long), new_tokens=1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

# ------------------------------------------------------------------ batched copies
# Copies between the device pool and the host tier are batched: a promotion walk or an eviction
# moves its blocks in a fixed number of copy operations, however many blocks, and every block
# arrives bit-exact, whichever way the batch is laid out (runs of blocks or scattered ones, slots
# handed over before the batch is written, blocks let go while their copy is queued).


def delta(pool, before, *keys):
    now = pool.stats()
    return tuple(now[k] - before[k] for k in keys)


def inherit(pool, model, prompt):
    """`inherit` as a forward does it (under the pool's lock); returns its referenced blocks."""
    fingerprint = current_fingerprint(model)
    with pool.locked():
        blocks, _ = pool.reuse.inherit(fingerprint, "default", prompt.numpy(), len(prompt) - 1,
                                       lambda digest, after: pool.promote(digest, fingerprint, after))
    return blocks


class CountOps(TorchDispatchMode):
    """Counts the torch operations run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scattered", [False, True], ids=["into a run of blocks", "into scattered blocks"])
def test_a_long_prefix_comes_back_from_the_host_bit_exact_in_one_batch(model, scattered):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=BLOCK, host_blocks=32))
    prompt = tokens(12 * BLOCK, 1)
    _, _, blocks = request(model, prompt, blocks=12)
    before = snapshot(pool, blocks)
    evict_all(pool)
    assert hf_paged_kv.cached_tokens(model, prompt) == {"device": 0, "host": 12 * BLOCK, "disk": 0}
    held = pool.allocate(pool.num_free()) if scattered else []
    pool.decref(held[::2])  # every other block free: the walk cannot continue a run
    stats = pool.stats()
    ids = torch.cat([prompt, tokens(5, 2)])
    skipped, out, promoted = request(model, ids, new_tokens=2, blocks=12)
    pool.decref(held[1::2])
    assert skipped == 12 * BLOCK
    assert (promoted == list(range(promoted[0], promoted[0] + 12))) != scattered
    for now, original in zip(snapshot(pool, promoted), before, strict=True):
        assert torch.equal(now, original)
    assert delta(pool, stats, "promotions", "copy_batches") == (12, 1)
    hf_paged_kv.disable(model)
    expected = greedy(model, DynamicCache(), ids[None], torch.ones(1, len(ids), dtype=torch.long), new_tokens=2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert_pool_clean(pool)


def test_one_eviction_demotes_every_block_bit_exact_in_one_batch(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=BLOCK, host_blocks=32))
    prompts = [tokens(5 * BLOCK, 3), tokens(7 * BLOCK, 4)]
    before = {}
    for prompt in prompts:
        _, _, blocks = request(model, prompt, blocks=len(prompt) // BLOCK)
        before[id(prompt)] = snapshot(pool, blocks)
    stats = pool.stats()
    evict_all(pool)  # both prefixes, leaves of both interleaved by value
    assert delta(pool, stats, "demotions", "copy_batches") == (12, 1)
    for prompt in prompts:
        assert hf_paged_kv.cached_tokens(model, prompt)["host"] == len(prompt)
        promoted = inherit(pool, model, torch.cat([prompt, tokens(1, 5)]))
        assert len(promoted) == len(prompt) // BLOCK
        for now, original in zip(snapshot(pool, promoted), before[id(prompt)], strict=True):
            assert torch.equal(now, original)
        pool.decref(promoted)
    assert_pool_clean(pool)


def test_a_promotion_under_an_outer_lock_is_done_by_settle_or_when_the_lock_is_let_go(model):
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=16, block_size=BLOCK, host_blocks=16))
    prompt = tokens(2 * BLOCK + 1, 9)
    _, _, blocks = request(model, prompt, blocks=2)
    before = snapshot(pool, blocks)
    evict_all(pool)
    fingerprint = current_fingerprint(model)
    pairs = pool.reuse.index.digest_pairs(fingerprint, "default", prompt.numpy(), 2)
    for (digest, _), original, settle in zip(pairs, before, (True, False), strict=True):
        with pool.locked():
            block, _, tier = pool.promote(digest, fingerprint)
            assert tier == "host" and pool.audit()["references"] == 2  # the caller's and the queued copy's
            if settle:
                pool.settle()
                assert pool.audit()["references"] == 1 and torch.equal(snapshot(pool, [block])[0], original)
        assert pool.audit()["references"] == 1
        assert torch.equal(snapshot(pool, [block])[0], original)
        pool.decref([block])
    assert_pool_clean(pool)


def test_a_full_host_tier_passes_on_blocks_of_the_batch_it_is_writing(model, tmp_path):
    """One eviction of more blocks than the host tier holds: blocks stored from this batch leave
    for disk before the batch is written, and must take their own data along."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, host_blocks=3, disk_dir=tmp_path))
    prompt = tokens(6 * BLOCK + 1, 10)
    _, _, blocks = request(model, prompt, blocks=6)
    before = snapshot(pool, blocks)
    evict_all(pool)
    assert hf_paged_kv.cached_tokens(model, prompt) == {"device": 0, "host": 3 * BLOCK, "disk": 3 * BLOCK}
    promoted = inherit(pool, model, prompt)
    assert len(promoted) == 6
    for now, original in zip(snapshot(pool, promoted), before, strict=True):
        assert torch.equal(now, original)
    pool.decref(promoted)
    assert_pool_clean(pool)


def test_a_failed_batch_copy_leaves_no_block_behind(model, monkeypatch):
    """The batched copy of a walk's promotions raises: the request fails with that error, its
    blocks leave the index (their data never came) and nothing stays referenced."""
    from hf_paged_kv.tiers.host import HostTier

    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, host_blocks=16))
    prompt = tokens(3 * BLOCK + 1, 12)
    request(model, prompt)
    evict_all(pool)

    flush = HostTier.flush

    def fails(self, targets):
        flush(self, targets)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(HostTier, "flush", fails)
        with pytest.raises(KeyboardInterrupt):
            request(model, prompt)
    assert hf_paged_kv.cached_tokens(model, prompt)["device"] == 0
    assert_pool_clean(pool)
    skipped, out = request(model, prompt, new_tokens=2)  # computed again, correctly
    assert skipped == 0
    hf_paged_kv.disable(model)
    expected = greedy(model, DynamicCache(), prompt[None], torch.ones(1, len(prompt), dtype=torch.long), new_tokens=2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def operations(model, blocks):
    """The torch operations one eviction of a `blocks`-block prefix and its promotion run."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=BLOCK, host_blocks=16))
    prompt = tokens(blocks * BLOCK + 1, 20 + blocks)
    request(model, prompt)
    with CountOps() as demotion:
        evict_all(pool)
    with CountOps() as promotion:
        promoted = inherit(pool, model, prompt)
    assert len(promoted) == blocks
    pool.decref(promoted)
    hf_paged_kv.disable(model)
    return demotion.counts, promotion.counts


def test_the_number_of_copy_operations_does_not_grow_with_the_blocks(model):
    """Per-block copies (or per-block views) would make these counts grow with the prefix."""
    few, many = operations(model, 2), operations(model, 9)
    assert few == many
    tensors = 2 * len(model.model.layers)  # a key and a value tensor per layer
    for counts in few:  # per tensor a gather, a copy and a scatter at most
        assert sum(counts[f"aten.{name}"] for name in ("copy_", "index_select", "index_copy_")) <= 3 * tensors, counts


def test_an_interrupted_demotion_batch_leaves_no_block_without_its_data(model, tmp_path, monkeypatch):
    """Ctrl-C in a disk write in the middle of one eviction's batch (a full host tier passing its
    lowest leaf on): every block the host tier lists holds its real data, a prompt asked again
    gives DynamicCache's tokens, and the next eviction works."""
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=BLOCK, host_blocks=4, disk_dir=tmp_path,
                                                  hot_threshold=None))
    try:
        prompt = tokens(4 * BLOCK, 1)
        request(model, prompt)
        request(model, tokens(4 * BLOCK, 7))  # evicted after the first prefix, in the same batch
        write = pool.tiers.disk.write
        writes = []

        def interrupted_once(meta, layers):
            writes.append(meta)
            if len(writes) == 1:
                raise KeyboardInterrupt
            return write(meta, layers)

        monkeypatch.setattr(pool.tiers.disk, "write", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            evict_all(pool)
        assert writes, "the eviction never reached the disk tier: the test does not test the case"
        request(model, tokens(3 * BLOCK, 9))
        evict_all(pool)  # a later batch (its commit once resolved the interrupted batch's rows in it)
        ids = torch.cat([prompt, tokens(3, 3)])
        inherited, out = request(model, ids)
        expected = greedy(model, DynamicCache(), ids[None], torch.ones(1, len(ids), dtype=torch.long), new_tokens=4)
        assert torch.equal(out, expected), f"inherited {inherited} tokens"
        pool.audit()
    finally:
        hf_paged_kv.disable(model)
