"""The block allocator and pool sizing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import greedy, make_model
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, PagedKVError, PoolExhaustedError
from hf_paged_kv.pool import LayerSpec, sizing
from hf_paged_kv.pool.allocator import BlockAllocator
from hf_paged_kv.pool.kv_pool import HUGE_PAGE, block_tensors
from hf_paged_kv.pool.sizing import DEFAULT_CPU_BYTES

CPU = torch.device("cpu")


def bound_pool(num_blocks=16, block_size=4, layers=2):
    pool = KVPool(num_blocks=num_blocks, block_size=block_size)
    pool.bind([LayerSpec(2, 8, CPU)] * layers, torch.float32)
    return pool


def test_layout_and_stats():
    pool = bound_pool(num_blocks=10, block_size=4, layers=3)
    assert len(pool.key_cache) == len(pool.value_cache) == 3
    assert pool.key_cache[0].shape == (10, 4, 2, 8)
    stats = pool.stats()
    for key in ("block_size", "num_blocks", "blocks_free", "blocks_used", "bytes_per_block", "tokens_stored",
                "blocks_used_high_water", "bytes_total"):
        assert key in stats
    assert stats["bytes_per_block"] == 3 * 2 * 4 * 2 * 8 * 4
    assert (stats["blocks_free"], stats["blocks_used"]) == (10, 0)


def test_sizing_by_bytes_and_default():
    spec = [LayerSpec(2, 8, CPU)] * 2
    per_block = 2 * 2 * 16 * 2 * 8 * 4
    pool = KVPool(max_bytes=10 * per_block + 7)
    pool.bind(spec, torch.float32)
    assert pool.num_blocks == 10
    default = KVPool()
    default.bind(spec, torch.float32)
    assert default.num_blocks == DEFAULT_CPU_BYTES // per_block


@pytest.mark.parametrize("kwargs", [dict(num_blocks=10**15), dict(max_bytes=1 << 62), dict(num_blocks=4, block_size=2**40)])
def test_sizes_that_cannot_be_allocated_are_refused_before_allocating(kwargs):
    pool = KVPool(**kwargs)
    with pytest.raises(PagedKVError, match=r"needs [\d,]+ bytes on cpu, but only [\d,]+ are available"):
        pool.bind([LayerSpec(2, 8, CPU)] * 2, torch.float32)
    assert not pool.is_bound


def test_a_host_tier_host_memory_cannot_hold_is_refused_before_allocating():
    pool = KVPool(num_blocks=8, host_blocks=10**13)
    with pytest.raises(PagedKVError, match=r"host tier of 10000000000000 blocks .* needs [\d,]+ bytes of host memory"):
        pool.bind([LayerSpec(2, 8, CPU)] * 2, torch.float32)
    assert not pool.is_bound


def fake_cgroups(tmp_path, membership: str, mount: str, files: dict[str, str]):
    """A /proc/self/cgroup line `membership`, a mountinfo line `mount` whose mount point is the
    directory "fs" here, and that mount holding `files` (path under the mount point -> text)."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "fs").mkdir(exist_ok=True)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    (tmp_path / "cgroup").write_text(membership + "\n")
    (tmp_path / "mountinfo").write_text("30 23 0:27 / /proc rw - proc proc rw\n"
                                        + mount.replace("MOUNT", str(tmp_path / "fs")) + "\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


GIB = 1 << 30


def test_cgroup_v2_headroom_is_the_tightest_level_less_file_cache(tmp_path):
    files = {"jobs/memory.max": str(8 * GIB), "jobs/memory.current": str(7 * GIB),
             "jobs/memory.stat": f"anon {5 * GIB}\nactive_file {GIB // 2}\ninactive_file {GIB}\n",
             "jobs/worker/memory.max": "max", "jobs/worker/memory.current": str(5 * GIB)}
    paths = fake_cgroups(tmp_path, "0::/jobs/worker", "40 31 0:38 / MOUNT rw - cgroup2 cgroup2 rw", files)
    assert sizing.cgroup_headroom(*paths) == 8 * GIB - (7 * GIB - GIB - GIB // 2)  # the parent's limit binds


def test_cgroup_v1_headroom_relative_to_the_mount_root(tmp_path):
    """A container sees its own cgroup at the mount point (the mount's root is its cgroup path)."""
    files = {"memory.limit_in_bytes": str(4 * GIB), "memory.usage_in_bytes": str(3 * GIB),
             "memory.stat": f"total_inactive_file {GIB // 2}\ntotal_active_file 0\n",
             "sub/memory.limit_in_bytes": "9223372036854771712", "sub/memory.usage_in_bytes": str(GIB)}
    mount = "35 31 0:32 /docker/abc MOUNT rw - cgroup cgroup rw,memory"
    paths = fake_cgroups(tmp_path, "4:memory:/docker/abc/sub\n3:cpu:/docker/abc", mount, files)
    assert sizing.cgroup_headroom(*paths) == 4 * GIB - (3 * GIB - GIB // 2)


def test_no_cgroup_limit_or_no_cgroups_leaves_host_memory_alone(tmp_path):
    unlimited = fake_cgroups(tmp_path / "a", "4:memory:/", "35 31 0:32 / MOUNT rw - cgroup cgroup rw,memory",
                             {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": str(GIB)})
    assert sizing.cgroup_headroom(*unlimited) is None
    garbled = fake_cgroups(tmp_path / "b", "garbage\n0::/x", "garbage - cgroup2\n40 31 0:38 / MOUNT rw - cgroup2 c rw",
                           {"x/memory.max": "lots", "x/memory.current": "1"})
    assert sizing.cgroup_headroom(*garbled) is None  # malformed lines and files are skipped, never fatal
    assert sizing.cgroup_headroom(str(tmp_path / "missing"), str(tmp_path / "missing")) is None


def test_a_cgroup_limit_bounds_host_sizing(monkeypatch):
    """In a container the machine's meminfo overstates what the process may use: memory_fraction
    and the host-tier check take the cgroup's headroom when it is less."""
    spec = [LayerSpec(2, 8, CPU)] * 2
    per_block = 2 * 2 * 16 * 2 * 8 * 4
    monkeypatch.setattr(sizing, "cgroup_headroom", lambda: 100 * per_block)
    pool = KVPool(memory_fraction=0.5)
    pool.bind(spec, torch.float32)
    assert pool.num_blocks == 50
    with pytest.raises(PagedKVError, match=r"host tier of 200 blocks .* but only [\d,]+ are available"):
        KVPool(num_blocks=8, host_blocks=200).bind(spec, torch.float32)


def test_a_failed_bind_leaves_the_pool_unbound(tmp_path):
    """A tier that cannot be built fails the bind before anything is assigned: enabling again
    fails the same way instead of running on half a pool."""
    model = make_model("llama", seed=3)
    pool = KVPool(num_blocks=8, disk_dir=tmp_path, disk_bytes=1)
    for _ in range(2):
        with pytest.raises(ValueError, match="cannot hold one block file"):
            hf_paged_kv.enable(model, pool=pool)
        assert not pool.is_bound and pool.num_blocks == 0


def test_rebinding_to_other_shapes_is_refused():
    pool = bound_pool()
    pool.bind([LayerSpec(2, 8, CPU)] * 2, torch.float32)  # same shapes: fine
    with pytest.raises(PagedKVError, match="already bound"):
        pool.bind([LayerSpec(4, 8, CPU)], torch.float32)


def _thp_eligible(address: int) -> bool:
    """Whether the kernel may back the mapping holding `address` with transparent huge pages."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "THPeligible:":
            return fields[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_cpu_blocks_lie_in_one_huge_page_region_zeroed_and_apart():
    """The CPU block tensors of a pool share one region that starts on a 2 MiB boundary and is
    advised for transparent huge pages (decode reads keys at the pool's token stride); each
    starts zeroed and none overlaps another. Tensors on other devices are allocated there."""
    shape = (64, 16, 3, 64)  # 768 KiB each in fp32: 3 MiB together
    tensors = block_tensors([(shape, CPU)] * 4 + [((2, 4, 3, 64), torch.device("meta"))], torch.float32)
    cpu, other = tensors[:4], tensors[4]
    assert other.device.type == "meta" and other.shape == (2, 4, 3, 64)
    for i, tensor in enumerate(cpu):
        assert tensor.shape == shape and tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert not tensor.any()
        tensor.fill_(i + 1)
    assert [tensor.unique().tolist() for tensor in cpu] == [[1.0], [2.0], [3.0], [4.0]]
    addresses = [tensor.data_ptr() for tensor in cpu]
    if sys.platform != "linux":
        return
    assert addresses[0] % HUGE_PAGE == 0
    assert [b - a for a, b in zip(addresses, addresses[1:])] == [cpu[0].nbytes] * 3
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert _thp_eligible(addresses[0]) and _thp_eligible(addresses[-1] + cpu[-1].nbytes - 1)


def test_copy_block_copies_every_layer():
    pool = bound_pool()
    for cache in pool.key_cache + pool.value_cache:
        cache[3].normal_()
    pool.copy_block(3, 7)
    for cache in pool.key_cache + pool.value_cache:
        assert torch.equal(cache[3], cache[7])


def test_growing_runs_stay_contiguous():
    """Sequences that grow one block at a time in turn (a batch decoding in lockstep) each keep
    one run of consecutive blocks: new runs start in the middle of the largest free stretch."""
    allocator = BlockAllocator(64)
    tails = [allocator.take(2) for _ in range(4)]
    for _ in range(5):
        for table in tails:
            table += allocator.take(1, after=table[-1])
    assert all(t == list(range(t[0], t[0] + len(t))) for t in tails), tails


def test_placement_falls_back_to_any_free_block():
    allocator = BlockAllocator(8)
    allocator.take(8)
    allocator.decref([1, 3, 5, 7])
    assert sorted(allocator.take(3)) == [1, 3, 5]
    assert allocator.num_free == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "free"]), st.integers(0, 6), st.integers(0, 10**6)),
                max_size=60))
def test_allocator_never_leaks_or_double_frees(ops):
    pool = bound_pool(num_blocks=12)
    held: list[int] = []  # one entry per reference we own
    for op, n, pick in ops:
        if op == "alloc":
            free_before = pool.num_free()
            if n > free_before:
                with pytest.raises(PoolExhaustedError):
                    pool.allocate(n)
                assert pool.num_free() == free_before  # nothing half-taken
            else:
                ids = pool.allocate(n, after=held[pick % len(held)] if held else None)
                assert len(set(ids)) == n and not set(ids) & set(held)
                held += ids
        elif op == "share" and held:
            block = held[pick % len(held)]
            pool.incref([block])
            held.append(block)
        elif op == "free" and held:
            block = held.pop(pick % len(held))
            pool.decref([block])
            if block not in held:  # last reference gone: a second free must be refused
                with pytest.raises(PagedKVError, match="double free"):
                    pool.decref([block])
        # invariants after every step
        report = pool.audit()
        assert report["references"] == len(held)
        assert report["blocks_free"] + len(set(held)) == pool.num_blocks
    pool.decref(held)
    assert pool.num_free() == pool.num_blocks and pool.audit()["references"] == 0


def test_every_block_let_go_is_reported_idle_whoever_lets_it_go():
    """The host tier must know when queued kernels are done with a block before a promotion
    may overwrite it. A block is let go by a sequence ending, and also by deduplication: a
    second request decoding the same tokens as the first drops its own copy of each block the
    first already indexed. Every block taken and free again was reported."""
    model = make_model("llama", seed=3)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=4))
    taken, reported, take, on_idle = set(), set(), pool.allocator.take, pool.allocator.on_idle

    def spy_take(*args, **kwargs):
        blocks = take(*args, **kwargs)
        taken.update(blocks)
        return blocks

    def spy_idle(blocks):
        reported.update(blocks)
        on_idle(blocks)

    pool.allocator.take, pool.allocator.on_idle = spy_take, spy_idle
    ids = torch.randint(3, 100, (1, 10), generator=torch.Generator().manual_seed(4))
    with PagedCache() as first:
        expected = greedy(model, first, ids, torch.ones_like(ids), new_tokens=12)
        indexed = first.block_tables()[0][:5]
    with PagedCache() as second:
        torch.testing.assert_close(greedy(model, second, ids, torch.ones_like(ids), new_tokens=12), expected,
                                   rtol=0, atol=0)
        assert second.block_tables()[0][:5] == indexed  # two inherited, three deduplicated
        let_go = {b for b in taken if pool.allocator.free[b]}
        assert let_go and let_go <= reported
