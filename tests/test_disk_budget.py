"""The disk tier's byte budget, driven at random: the file it drops is the one a scan of its
catalogue would drop (an expired file, else the lowest-value leaf, the file just written only
when nothing else can go), and its byte count always equals the bytes of the files it knows."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import droppable

from hf_paged_kv.pool.policy import BlockMeta, Policy
from hf_paged_kv.tiers.disk import DiskTier

SHAPES = [(2, 2, 4)] * 2


def lowest_droppable(metas: dict, now: float, half_life: float, spare: bytes) -> float | None:
    return min((metas[d].value(now, half_life) for d in droppable(metas, now) if d != spare), default=None)


def files_on_disk(directory) -> int:
    return sum(path.stat().st_size for path in directory.glob("*.kvblock"))


@pytest.mark.parametrize("seed", range(16))
def test_the_disk_budget_drops_what_a_scan_drops_and_counts_every_byte(tmp_path, seed):
    rng = random.Random(seed)
    clock = [0.0]
    policy = Policy(half_life=rng.choice([5.0, 60.0]), ttl=rng.choice([None, 40.0]), clock=lambda: clock[0])
    layers = [(torch.randn(s), torch.randn(s)) for s in SHAPES]
    probe = DiskTier(tmp_path / "probe", 1 << 20, SHAPES, torch.float32, policy, "m")
    probe.write(BlockMeta(b"probe", "t", 0, "m", parent=b"root"), layers)
    tier = DiskTier(tmp_path / "tier", probe.used_bytes() * rng.choice([3, 12]), SHAPES, torch.float32, policy, "m")
    digests, drops = [b"root"], 0
    for step in range(160):
        clock[0] += rng.random() * 3
        action = rng.random()
        if action < 0.6 or not tier.catalog:  # a block falls out of the host tier
            digest = bytes([seed, step])
            meta = BlockMeta(digest, rng.choice(["a", "b"]), rng.randrange(6), "m", weight=rng.choice([0.2, 1.0, 4.0]),
                             last_access=clock[0] - rng.random() * 10, priority=rng.randrange(-1, 2),
                             expires=clock[0] + rng.random() * 30 if rng.random() < 0.3 else None,
                             parent=rng.choice(digests[-8:]))
            before = {d: m for d, (_, _, m) in tier.catalog.items()}
            kept = tier.write(meta, layers)
            after = {d: m for d, (_, _, m) in tier.catalog.items()}
            held = before | {digest: after.get(digest, meta.as_of(clock[0], policy.half_life))}
            gone = [d for d in held if d not in after]
            assert kept == (digest in after)
            if len(gone) == 1:  # the usual case: one file makes room for one
                expected = lowest_droppable(held, clock[0], policy.half_life, spare=digest)
                if expected is None:
                    assert gone == [digest]
                else:
                    assert gone[0] in droppable(held, clock[0]) and gone[0] != digest
                    assert held[gone[0]].value(clock[0], policy.half_life) == pytest.approx(expected, rel=1e-9)
            drops += len(gone)
            digests.append(digest)
            assert tier.used_bytes() <= tier.max_bytes
        elif action < 0.7:  # a block comes back to the device more used than its file says
            digest = rng.choice(list(tier.catalog))
            meta = tier.catalog[digest][2]
            tier.write(BlockMeta(digest, meta.tenant, meta.depth, "m", weight=meta.weight + 5, last_access=clock[0],
                                 parent=meta.parent), layers)
        elif action < 0.8:  # a file is damaged and found so when loaded
            digest = rng.choice(list(tier.catalog))
            path = tier.catalog[digest][0]
            data = bytearray(path.read_bytes())
            data[-1] = (data[-1] + 1) % 256  # the last tensor changed: same size, checksum mismatch
            path.write_bytes(bytes(data))
            with pytest.warns(UserWarning, match="ignoring"):
                assert tier.load(digest, "m", [(torch.empty(s), torch.empty(s)) for s in SHAPES]) is None
        elif action < 0.85:
            tier.forget(tenant=rng.choice(["a", "b"]))
        elif action < 0.9:  # the weights change and come back
            tier.set_aside("m")
            assert not tier.catalog
            tier.serve("m")
        else:
            policy.half_life = rng.choice([2.0, 30.0, 600.0])
        assert tier.used_bytes() == files_on_disk(tmp_path / "tier")
        assert tier.stats()["disk_drops"] + tier.stats()["disk_expirations"] >= drops
    assert drops > 0


def test_an_expired_block_is_not_written(tmp_path):
    clock = [100.0]
    policy = Policy(half_life=60.0, clock=lambda: clock[0])
    tier = DiskTier(tmp_path, 1 << 20, SHAPES, torch.float32, policy, "m")
    layers = [(torch.randn(s), torch.randn(s)) for s in SHAPES]
    assert not tier.write(BlockMeta(b"old", "t", 0, "m", expires=100.0), layers)
    assert tier.write(BlockMeta(b"new", "t", 0, "m", expires=100.5), layers)
    assert list(tier.catalog) == [b"new"] and len(list(tmp_path.glob("*.kvblock"))) == 1
    assert tier.stats()["disk_writes"] == 1
