"""The block size advisor: short sequences favour small blocks, long ones large blocks, and a
shared prefix that ends inside a block counts against that size."""

from __future__ import annotations

import pytest

from hf_paged_kv import advise_block_size


def test_short_sequences_get_small_blocks_and_long_ones_large_blocks():
    short = advise_block_size([12, 20, 9, 30, 17] * 20)
    long = advise_block_size([3000, 4100, 2500, 5000] * 20)
    assert short.block_size <= 16 < long.block_size
    waste = {r["block_size"]: r["memory_waste"] for r in short.table}
    assert waste[8] < waste[16] < waste[64]


def test_a_shared_prefix_that_splits_a_block_costs_reuse():
    lengths = [700] * 50
    advice = advise_block_size(lengths, shared_prefix_lengths=[600])  # 600 = 37.5 blocks of 16, 9.375 of 64
    loss = {r["block_size"]: r["reuse_loss"] for r in advice.table}
    assert loss[8] == 0 and loss[64] == pytest.approx(24 / 600) and advice.block_size <= 16
    assert "recommended block size" in str(advice)


def test_no_lengths_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        advise_block_size([])
