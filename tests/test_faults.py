"""The disk tier under faults: damaged files of any kind are skipped and counted, never loaded and
never fatal; a directory that cannot be written leaves the pool consistent."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from conftest import VOCAB, assert_pool_clean, greedy, make_model
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache

BLOCK = 8


def tokens(n, seed):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def persisted(tmp_path_factory):
    """One block persisted by a first "process"; its file's bytes and header length."""
    directory = tmp_path_factory.mktemp("disk")
    writer = make_model("llama", seed=71)
    hf_paged_kv.enable(writer, pool=KVPool(num_blocks=16, block_size=BLOCK, disk_dir=directory))
    prefix = tokens(BLOCK, 1)
    assert hf_paged_kv.persist(writer, prefix) == BLOCK
    hf_paged_kv.disable(writer)
    (path,) = directory.glob("*.kvblock")
    data = path.read_bytes()
    return path.name, data, 8 + int.from_bytes(data[:8], "little"), prefix


def header_positions(header_end: int) -> list[int]:
    """Bytes of the header to damage: the length field, then a spread over the JSON (key names,
    the digest, shapes, offsets, the fill and weight fields, the checksum)."""
    return list(range(8)) + list(range(8, header_end, max(1, (header_end - 8) // 40)))


def test_any_flipped_bit_in_a_header_is_skipped_and_counted(persisted, tmp_path):
    name, data, header_end, prefix = persisted
    model = make_model("llama", seed=71)
    prompt = torch.cat([prefix, tokens(5, 2)], 1)
    expected = greedy(model, DynamicCache(), prompt, torch.ones_like(prompt), new_tokens=3)
    for position in header_positions(header_end):
        for bit in (0, 6):
            damaged = bytearray(data)
            damaged[position] ^= 1 << bit
            directory = tmp_path / f"at{position}-{bit}"
            directory.mkdir()
            (directory / name).write_bytes(bytes(damaged))
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=16, block_size=BLOCK, disk_dir=directory))
                with PagedCache() as cache:
                    got = greedy(model, cache, prompt, torch.ones_like(prompt), new_tokens=3)
                    inherited = cache.inherited[0]
            stats = pool.stats()
            hf_paged_kv.disable(model)
            assert inherited == 0 and stats["disk_hits"] == 0, (position, bit)  # never loaded
            assert stats["disk_rejects"] >= 1, (position, bit)  # and counted
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            assert_pool_clean(pool)  # no block leaked


def test_an_intact_file_is_reused(persisted, tmp_path):
    name, data, _, prefix = persisted
    (tmp_path / name).write_bytes(data)
    model = make_model("llama", seed=71)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=16, block_size=BLOCK, disk_dir=tmp_path))
    prompt = torch.cat([prefix, tokens(5, 2)], 1)
    with PagedCache() as cache:
        greedy(model, cache, prompt, torch.ones_like(prompt), new_tokens=3)
        assert cache.inherited == [BLOCK]
    assert pool.stats()["disk_hits"] == 1 and pool.stats()["disk_rejects"] == 0
    hf_paged_kv.disable(model)


def test_unwritable_directory_drops_blocks_cleanly(tmp_path):
    directory = tmp_path / "tier"
    model = make_model("llama", seed=72)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=12, block_size=BLOCK, disk_dir=directory))
    shutil.rmtree(directory)
    directory.write_text("not a directory any more")  # every write now fails, whatever the permissions
    prompts = [tokens(30, seed) for seed in range(3, 7)]
    with pytest.warns(UserWarning, match="cannot write to") as caught:
        for ids in prompts:  # each request evicts the previous one's blocks towards the disk
            with PagedCache() as cache:
                got = greedy(model, cache, ids, torch.ones_like(ids), new_tokens=3)
            hf_paged_kv.disable(model)
            torch.testing.assert_close(got, greedy(model, DynamicCache(), ids, torch.ones_like(ids), new_tokens=3),
                                       rtol=0, atol=0)
            hf_paged_kv.enable(model, pool=pool)
    assert len([w for w in caught if "cannot write to" in str(w.message)]) == 1  # warned once
    stats = pool.stats()
    assert stats["disk_write_errors"] > 0 and stats["disk_blocks"] == 0
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


def test_a_block_file_that_cannot_be_deleted_is_counted_never_fatal(tmp_path, monkeypatch):
    """A read-only tier cannot delete an expired file: the request goes on (the file is
    forgotten, counted in disk_delete_errors, warned once), and the pool stays consistent."""
    from pathlib import Path

    from conftest import manual_clock

    model = make_model("llama", seed=73)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=16, block_size=BLOCK, disk_dir=tmp_path, ttl=60.0))
    clock = manual_clock(pool)
    prefix = tokens(2 * BLOCK, 8)
    assert hf_paged_kv.persist(model, prefix) == 2 * BLOCK
    clock[0] = 3600.0  # every file has expired

    def refuse(path, missing_ok=False):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(Path, "unlink", refuse)
    ids = torch.cat([prefix, tokens(3, 9)], 1)
    with pytest.warns(UserWarning, match="cannot delete"):
        with PagedCache() as cache:
            got = greedy(model, cache, ids, torch.ones_like(ids), new_tokens=3)
    monkeypatch.undo()
    hf_paged_kv.disable(model)
    torch.testing.assert_close(got, greedy(model, DynamicCache(), ids, torch.ones_like(ids), new_tokens=3), rtol=0, atol=0)
    assert pool.stats()["disk_delete_errors"] >= 1
    assert_pool_clean(pool)


def test_a_promotion_that_raises_keeps_no_block_it_found_before(tmp_path, monkeypatch):
    """The second block of a prefix fails to come back from disk: the request fails with that
    error, and the first block, already found and referenced, is given back."""
    from hf_paged_kv.tiers.disk import DiskTier

    writer = make_model("llama", seed=74)
    hf_paged_kv.enable(writer, pool=KVPool(num_blocks=16, block_size=BLOCK, disk_dir=tmp_path))
    prefix = tokens(2 * BLOCK, 10)
    assert hf_paged_kv.persist(writer, prefix) == 2 * BLOCK
    hf_paged_kv.disable(writer)
    pool = hf_paged_kv.enable(writer, pool=KVPool(num_blocks=16, block_size=BLOCK, disk_dir=tmp_path))  # a restart
    load, calls = DiskTier.load, []

    def second_fails(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the disk went away")
        return load(self, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "load", second_fails)
    ids = torch.cat([prefix, tokens(3, 11)], 1)
    with pytest.raises(RuntimeError, match="the disk went away"):
        with PagedCache() as cache:
            greedy(writer, cache, ids, torch.ones_like(ids), new_tokens=2)
    assert len(calls) == 2
    assert_pool_clean(pool)
    hf_paged_kv.disable(writer)


def test_persist_reports_only_what_reached_the_disk(tmp_path):
    directory = tmp_path / "tier"
    model = make_model("llama", seed=75)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=16, block_size=BLOCK, disk_dir=directory))
    assert hf_paged_kv.persist(model, tokens(2 * BLOCK, 12)) == 2 * BLOCK
    shutil.rmtree(directory)
    directory.write_text("not a directory any more")  # every write now fails
    with pytest.warns(UserWarning, match="cannot write to"):
        assert hf_paged_kv.persist(model, tokens(2 * BLOCK, 13)) == 0
    assert_pool_clean(pool)
    hf_paged_kv.disable(model)


def test_a_fault_in_the_load_controller_fails_no_request(monkeypatch, caplog):
    """The controller adapts the service: a fault in its tick (its metrics once raised on a huge
    priority) is logged once and the engine serves on with its knobs as they are."""
    from hf_paged_kv import Engine

    model = make_model("llama", seed=3)
    engine = Engine(model, pool=KVPool(num_blocks=64, block_size=8))

    def broken_tick():
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(engine.load, "tick", broken_tick)
    with engine:
        handles = [engine.submit([5 + i, 6, 7, 8], max_new_tokens=4, eos_token_id=[]) for i in range(3)]
        assert [len(h.result(timeout=60)) for h in handles] == [4, 4, 4]
    stats = engine.stats()
    assert stats["requests_failed"] == 0 and stats["requests_finished"] == 3
    assert stats["controller_faults"] >= 1 and "hf_paged_kv_controller_faults_total" in engine.prometheus()
    assert sum("load controller's tick failed" in r.message for r in caplog.records) == 1
    assert_pool_clean(engine.pool)
    hf_paged_kv.disable(model)
