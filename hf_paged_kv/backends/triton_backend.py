"""The Triton backend: writes with `write_kv`, reads with `paged_decode` (one new token per
sequence) or `paged_prefill` (several), straight from the blocks. The default on CUDA.

Every launch size comes from the plan's host arrays, so a layer never waits for the GPU, and
what the layers of a forward share (per-row tensors in the kernels' form, split counts, compile
constants: `DecodeSetup`, `WriteSetup`) is built once per forward in the plan's memo: on a GPU a
decode step of a small model is bound by the host's time per layer. The rare forwards the kernels do not cover – attention weights asked for, sliding windows over a
batch with holes in its padding, head dims other than 64, 96 and 128 – run on the torch
backend's path instead.
"""

from __future__ import annotations

import torch

from hf_paged_kv.kernels.paged_decode import DecodeSetup, choose_splits
from hf_paged_kv.kernels.paged_prefill import paged_prefill
from hf_paged_kv.kernels.triton_utils import unsupported
from hf_paged_kv.kernels.write_kv import WriteSetup

from ..cache.step import to_device
from .torch_backend import TorchBackend


def row_tensors(plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan's block tables, sequence lengths and query positions on `device` (each copied
    there once per forward: `plan.on`)."""
    return tuple(plan.on(name, device) for name in ("block_tables", "kv_lens", "q_pos"))


class TritonBackend:
    name = "triton"

    def __init__(self, pool):
        self.pool = pool
        self.fallback = TorchBackend(pool)

    def write(self, plan, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the forward's new K/V (`[B, kv_heads, T, head_dim]`) at the plan's slots."""
        key_cache, value_cache = self.pool.key_cache[layer], self.pool.value_cache[layer]
        key, value = key.transpose(1, 2), value.transpose(1, 2)
        memo = ("triton-write", key.device, key.shape, key_cache.shape)
        if memo not in plan.memo:
            plan.memo[memo] = WriteSetup.build(key_cache, key, plan.on("slot_mapping", key.device))
        launch = plan.memo[memo].launch(key_cache, value_cache, key, value)
        if launch is not None:
            launch.run()

    def attention(self, query, layer: int, plan, scale: float, window=None, softcap=None, need_weights=False,
                  new_kv=None):
        """`query` `[B, heads, T, head_dim]` against the paged KV of `layer`; same shape out.
        `new_kv` is not used: the kernels read every key from the pool."""
        caches = self.pool.key_cache[layer], self.pool.value_cache[layer]
        # what the kernels do not implement (weights, windows over holes, head dims such as 16, 80 or 256,
        # mixed dtypes) runs on the torch backend, on the same device, instead of failing the forward
        if need_weights or (window is not None and plan.q_logical is not None) or unsupported(query, caches[0]):
            return self.fallback.attention(query, layer, plan, scale, window, softcap, need_weights)
        if query.shape[0] == plan.num_sequences:  # one sequence per row
            batch, _, width, _ = query.shape
            if width == 1:
                return self._decode(query[:, :, 0], caches, plan, scale, window, softcap)[:, :, None], None
            tables, kv_lens, q_pos = row_tensors(plan, query.device)
            return paged_prefill(query, *caches, tables, kv_lens, q_pos.view(batch, width), scale, window,
                                 softcap=softcap), None
        return self._packed(query, caches, plan, scale, window, softcap), None

    def _decode(self, query, caches, plan, scale, window, softcap, rows=None):
        """`paged_decode` of one query per row: the plan's sequences, or those at `rows` of the
        plan's decodes (`_packed`: query rows, sequences)."""
        memo = ("triton-decode", query.device, query.shape, query.stride(), query.dtype, caches[0].shape,
                caches[0].stride(), window, softcap, rows is None)
        if memo not in plan.memo:
            tables, kv_lens, q_pos = row_tensors(plan, query.device)
            if rows is not None:
                query_rows, sequences = rows
                tables, kv_lens, q_pos = tables[sequences], kv_lens[sequences], q_pos[query_rows]
            splits = choose_splits(query.shape[0], caches[0].shape[2], plan.max_kv_len, query.device)
            plan.memo[memo] = DecodeSetup.build(query, caches[0], tables, kv_lens, q_pos, window, splits, softcap)
        out = torch.empty_like(query)
        for launch in plan.memo[memo].launches(query, *caches, scale, out):
            launch.run()
        return out

    def _packed(self, query, caches, plan, scale, window, softcap):
        """The serving engine's packed row: decodes in one `paged_decode`, each prefill chunk
        in its own `paged_prefill`."""
        flat = query[0].transpose(0, 1)  # [Q, heads, dim]
        out = torch.empty_like(flat)
        decodes, chunks = plan.single_and_chunked
        if len(decodes):
            key = ("triton-decodes", query.device)  # the same for every layer: copied to the device once
            if key not in plan.memo:
                plan.memo[key] = to_device(plan.q_start[decodes], query.device), to_device(decodes, query.device)
            rows = plan.memo[key]
            out[rows[0]] = self._decode(flat[rows[0]], caches, plan, scale, window, softcap, rows)
        if len(chunks):
            tables, kv_lens, q_pos = row_tensors(plan, query.device)
        for sequence in chunks.tolist():
            lo, hi = int(plan.q_start[sequence]), int(plan.q_start[sequence + 1])
            chunk = flat[lo:hi].transpose(0, 1)[None]
            out[lo:hi] = paged_prefill(chunk, *caches, tables[sequence : sequence + 1], kv_lens[sequence : sequence + 1],
                                       q_pos[lo:hi][None], scale, window, softcap=softcap)[0].transpose(0, 1)
        return out.transpose(0, 1)[None]
