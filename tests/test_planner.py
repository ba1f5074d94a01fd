"""The planner's arithmetic on its own: pure functions from sequences and new tokens to a
StepPlan (no model, no pool)."""

from __future__ import annotations

import numpy as np
import torch

from hf_paged_kv.cache.forward_plan import ForwardPlan
from hf_paged_kv.cache.planner import columns_to_skip, plan_batch, plan_packed
from hf_paged_kv.cache.sequence import Sequence

SIZE = 4


def seq(blocks, length=0, history=None):
    return Sequence(blocks=list(blocks), length=length, tokens=[7] * length,
                    history=bytearray([1] * length if history is None else history))


def test_left_padded_prefill_writes_real_tokens_only():
    real = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=bool)
    plan = plan_batch([seq([5, 6]), seq([9])], real, SIZE)
    assert plan.batch_shape == (2, 6)
    assert plan.slot_mapping.reshape(2, 6).tolist() == [[20, 21, 22, 23, 24, 25], [-1, -1, -1, 36, 37, 38]]
    assert plan.q_pos.reshape(2, 6).tolist() == [[0, 1, 2, 3, 4, 5], [-1, -1, -1, 0, 1, 2]]  # leading pads see nothing
    assert plan.kv_lens.tolist() == [6, 3]
    assert plan.contiguous.tolist() == [5, 9]
    assert plan.q_logical is None  # stored = logical - constant: windows need no logical positions


def test_right_padding_and_holes_let_pads_see_the_real_tokens_before_them():
    real = np.array([[1, 1, 0, 1, 0, 0]], dtype=bool)
    plan = plan_batch([seq([3, 4])], real, SIZE)
    assert plan.slot_mapping.tolist() == [12, 13, -1, 14, -1, -1]
    assert plan.q_pos.tolist() == [0, 1, 1, 2, 2, 2]
    assert plan.q_logical.tolist() == [0, 1, 2, 3, 4, 5]
    assert plan.k_logical.tolist() == [[0, 1, 3]]  # logical position of each stored key


def test_decode_after_right_padding_keeps_logical_positions():
    earlier = seq([3], length=2, history=[1, 1, 0, 0])  # two tokens stored, two pads
    plan = plan_batch([earlier], np.ones((1, 1), dtype=bool), SIZE)
    assert plan.slot_mapping.tolist() == [14] and plan.q_pos.tolist() == [2] and plan.decode_only
    assert plan.q_logical.tolist() == [4] and plan.k_logical.tolist() == [[0, 1, 4]]


def test_inherited_prefix_is_not_rewritten_and_leading_columns_are_skipped():
    real = np.ones((2, 10), dtype=bool)
    inherited = np.array([8, 4])
    sequences = [seq([1, 2, 3], length=8), seq([4, 5, 6], length=4)]
    skip = columns_to_skip(real, inherited)
    assert skip == 4  # row 1 computes from column 4 on
    plan = plan_batch(sequences, real, SIZE, inherited=inherited, skip=skip)
    assert plan.batch_shape == (2, 6)
    assert plan.slot_mapping.reshape(2, 6).tolist() == [[-1, -1, -1, -1, 12, 13], [20, 21, 22, 23, 24, 25]]
    assert plan.q_pos.reshape(2, 6).tolist() == [[4, 5, 6, 7, 8, 9], [4, 5, 6, 7, 8, 9]]


def test_a_planned_forward_drops_the_skipped_columns_of_every_per_token_input_alike():
    """The model sees the columns some row computes, at the positions the caller gave them."""
    real, inherited = np.ones((1, 6), dtype=bool), np.array([4])
    step = plan_batch([seq([1, 2], length=4)], real, SIZE, inherited=inherited, skip=columns_to_skip(real, inherited))
    plan = ForwardPlan(step, [], real, np.arange(6)[None], inherited, [], new_turn=True, need_weights=False)
    given = {"input_ids": torch.arange(6)[None], "attention_mask": torch.ones(1, 6, dtype=torch.long),
             "position_ids": torch.arange(6)[None], "logits_to_keep": 1}
    inputs = plan.inputs(given)
    assert [inputs[name].tolist() for name in ("input_ids", "position_ids")] == [[[4, 5]], [[4, 5]]]
    assert inputs["attention_mask"].shape == (1, 2) and inputs["logits_to_keep"] == 1
    assert given["input_ids"].shape == (1, 6)  # the caller's arguments stay as they were


def test_the_last_column_is_always_computed():
    assert columns_to_skip(np.ones((1, 5), dtype=bool), np.array([5])) == 4


def test_rows_sharing_another_rows_blocks_write_nothing():
    real = np.ones((2, 3), dtype=bool)
    plan = plan_batch([seq([2]), seq([2])], real, SIZE, writers=np.array([True, False]))
    assert plan.slot_mapping.reshape(2, 3).tolist() == [[8, 9, 10], [-1, -1, -1]]
    assert plan.q_pos.reshape(2, 3).tolist() == [[0, 1, 2], [0, 1, 2]]


def test_a_sequence_without_blocks_for_its_tokens_is_a_caller_error():
    import pytest

    from hf_paged_kv import PagedKVError

    with pytest.raises(PagedKVError, match="has no block for"):
        plan_packed([seq([20], length=4)], [1], SIZE)


def test_fragmented_tables_are_not_contiguous():
    plan = plan_batch([seq([7, 2], length=5)], np.ones((1, 1), dtype=bool), SIZE)
    assert plan.contiguous.tolist() == [-1]
    assert plan.slot_mapping.tolist() == [9]  # position 5: block 2, offset 1


def test_packed_step_with_sequences_joining_and_leaving():
    """Engine steps: decodes and a prefill chunk in one row; between steps a sequence finishes
    and another joins, and each keeps its own positions and blocks."""
    a, b, c = seq([0, 1], length=5), seq([10, 11]), seq([20, 21], length=3)
    plan = plan_packed([a, b, c], [1, 6, 1], SIZE)
    assert plan.batch_shape == (1, 8)
    assert plan.q_start.tolist() == [0, 1, 7, 8]
    assert plan.q_pos.tolist() == [5, 0, 1, 2, 3, 4, 5, 3]
    assert plan.slot_mapping.tolist() == [5, 40, 41, 42, 43, 44, 45, 83]
    assert plan.kv_lens.tolist() == [6, 6, 4]
    # next step: a finished and left, b decodes, d joins with a chunk, c decodes
    b.length, c.length = 6, 4
    d = seq([30, 31])
    plan = plan_packed([b, d, c], [1, 3, 1], SIZE)
    assert plan.q_start.tolist() == [0, 1, 4, 5]
    assert plan.q_pos.tolist() == [6, 0, 1, 2, 4]
    assert plan.slot_mapping.tolist() == [46, 120, 121, 122, 84]
    assert plan.query_counts.tolist() == [1, 3, 1] and not plan.decode_only
