"""`LeafQueue` picks, without scanning, the block a tier drops next: it must pick what a scan
of the tier picks (`droppable`, lowest value first, expired blocks first) whatever the adds,
removals, clock and half-life."""

from __future__ import annotations

import random

import pytest
from conftest import droppable

from hf_paged_kv.pool.policy import BlockMeta, Policy
from hf_paged_kv.tiers.leaves import LeafQueue


def scanned_value(held: dict, policy: Policy, now: float, spare=None) -> float | None:
    """The value of the block a scan would drop: the lowest of the droppable ones but `spare`."""
    return min((held[k].value(now, policy.half_life) for k in droppable(held, now) if k != spare), default=None)


@pytest.mark.parametrize("seed", range(60))
def test_the_queue_picks_what_a_scan_picks(seed):
    rng = random.Random(seed)
    clock = [0.0]
    policy = Policy(half_life=rng.choice([5.0, 60.0]), clock=lambda: clock[0])
    queue, held, digests, key = LeafQueue(policy), {}, [b"root"], None
    for step in range(400):
        clock[0] += rng.random() * 3
        action = rng.random()
        if action < 0.5 or not held:  # a block arrives, continuing one held, gone or its namespace root
            digest = bytes([seed, step % 256, step // 256])
            parent = rng.choice(digests[-20:])
            meta = BlockMeta(digest, "t", rng.randrange(8), "m", weight=rng.choice([0.1, 1.0, 3.0]),
                             last_access=clock[0] - rng.random() * 20, priority=rng.randrange(-2, 3),
                             expires=clock[0] + rng.random() * 60 if rng.random() < 0.3 else None, parent=parent)
            key = rng.randrange(10**9)
            queue.add(key, meta)
            held[key] = meta
            digests.append(digest)
        elif action < 0.7:  # a block leaves by another way (promoted, forgotten)
            key = rng.choice(list(held))
            queue.remove(key, held.pop(key))
        elif action < 0.75:  # the controller retunes the half-life
            policy.half_life = rng.choice([2.0, 30.0, 600.0])
        else:  # the tier is full: its next victim leaves, sometimes sparing the block just added
            spare = rng.choice([None, key])
            expected = scanned_value(held, policy, clock[0], spare)
            key = queue.lowest(clock[0], spare=spare)
            if expected is None:
                assert key is None
                continue
            assert key in droppable(held, clock[0]) and key != spare
            assert held[key].value(clock[0], policy.half_life) == pytest.approx(expected, rel=1e-9)
            queue.remove(key, held.pop(key))
    while held:
        key = queue.lowest(clock[0])
        assert held[key].value(clock[0], policy.half_life) == pytest.approx(scanned_value(held, policy, clock[0]),
                                                                             rel=1e-9)
        queue.remove(key, held.pop(key))
    assert queue.lowest(clock[0]) is None


def test_the_heaps_stay_within_a_bound_of_the_blocks_held():
    """Entries of blocks that left are skipped lazily; a tier that churns through many blocks
    that expire later must not keep one entry per block it ever held."""
    clock = [0.0]
    policy = Policy(half_life=60.0, clock=lambda: clock[0])
    queue = LeafQueue(policy)
    for step in range(5000):
        meta = BlockMeta(step.to_bytes(4, "big"), "t", 0, "m", last_access=clock[0], expires=clock[0] + 1e6)
        queue.add(step, meta)
        if step >= 3:
            queue.remove(step - 3, queue.held[step - 3])
    assert len(queue.held) == 3
    assert len(queue.ranked) <= 4 * 3 + 64 + 1 and len(queue.expiring) <= 4 * 3 + 64 + 1
