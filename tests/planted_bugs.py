"""A pytest plugin that plants one deliberate attention bug in the library, chosen by the
environment variable HF_PAGED_KV_PLANT; `test_planted_bugs.py` runs the equality tests with it
and checks that they catch it.

    HF_PAGED_KV_PLANT=scale python -m pytest -p planted_bugs test_generate.py

Each bug is the kind that nearly uniform attention (weak test models) would hide: the wrong
softmax scale, query heads paired with the wrong KV heads, a reused prefix at the wrong
positions, one stored key missing, keys paired with the wrong values inside a block, and a
small numeric skew that only decode steps see.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_paged_kv.cache.forward_plan import ForwardPlan
from hf_paged_kv.backends.torch_backend import TorchBackend
from hf_paged_kv.kernels import reference

BUGS = ("scale", "heads_rotated", "reused_positions_shifted", "cached_key_dropped", "kv_permuted_in_block",
        "decode_skew")


def pytest_runtest_makereport(item, call):
    """Record in the file HF_PAGED_KV_PLANT_CRASHES names a test that failed by raising anything
    but a failed check: a plant that no longer fits the code it patches raises, and must not
    count as caught."""
    path = os.environ.get("HF_PAGED_KV_PLANT_CRASHES")
    if path and call.when == "call" and call.excinfo is not None and not call.excinfo.errisinstance(
            (AssertionError, pytest.fail.Exception)):
        with open(path, "a") as crashes:
            crashes.write(f"{item.nodeid}: {call.excinfo.typename}: {call.excinfo.value}\n")


def pytest_configure(config):
    bug = os.environ.get("HF_PAGED_KV_PLANT")
    if bug is None:
        return
    if bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; one of {BUGS}")
    globals()[f"plant_{bug}"]()


def plant_scale():
    attention = TorchBackend.attention
    TorchBackend.attention = lambda self, q, layer, plan, scale, *a, **k: attention(self, q, layer, plan, scale * 1.1,
                                                                                  *a, **k)


def plant_heads_rotated():
    attention = TorchBackend.attention
    TorchBackend.attention = lambda self, q, *a, **k: attention(self, q.roll(1, dims=1), *a, **k)


def plant_reused_positions_shifted():
    inputs = ForwardPlan.inputs

    def shifted(self, kwargs):
        kwargs = inputs(self, kwargs)
        if self.step.skip:  # a copy: the forward's own arguments stay as they were
            kwargs["position_ids"] = kwargs["position_ids"] + 1
        return kwargs

    ForwardPlan.inputs = shifted


def plant_cached_key_dropped():
    sdpa = reference.sdpa

    def without_first_key(query, keys, values, mask, scale, is_causal=False):
        length = keys.shape[2]
        if length < 2:
            return sdpa(query, keys, values, mask, scale, is_causal)
        if mask is None:
            positions = torch.arange(length, device=query.device)
            width = query.shape[2]
            mask = (positions[None, :] <= positions[-width:, None]) if is_causal else torch.ones(width, length,
                                                                                               dtype=torch.bool)
            mask = mask[None, None]
        return sdpa(query, keys[:, :, 1:], values[:, :, 1:], mask[..., 1:], scale)

    reference.sdpa = without_first_key


def plant_kv_permuted_in_block():
    def permuted(self, plan, layer, key, value):
        """Each token's value goes one slot further within its block than its key."""
        src, dst = self._write_indices(plan, key.device)
        if dst.numel() == 0:
            return
        size, heads, dim = plan.block_size, key.shape[1], key.shape[3]
        every = torch.arange(key.shape[0] * key.shape[2])
        flat = lambda states: states.transpose(1, 2).reshape(-1, heads, dim).index_select(  # noqa: E731
            0, every if src is None else src)
        shifted = dst - dst % size + (dst % size + 1) % size
        self.pool.key_cache[layer].view(-1, heads, dim).index_copy_(0, dst, flat(key))
        self.pool.value_cache[layer].view(-1, heads, dim).index_copy_(0, shifted, flat(value))

    TorchBackend.write = permuted


def plant_decode_skew():
    attention = TorchBackend.attention

    def skewed(self, query, *args, **kwargs):
        out, weights = attention(self, query, *args, **kwargs)
        return (out * 1.05 if query.shape[2] == 1 else out), weights

    TorchBackend.attention = skewed
