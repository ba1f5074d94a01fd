"""The Triton backend: writes with `write_kv`, reads with `paged_decode` (one new token per
sequence) or `paged_prefill` (several), straight from the blocks. The default on CUDA.

Every launch size comes from the plan's host arrays, so a layer never waits for the GPU. The
rare forwards the kernels do not cover – attention weights asked for, sliding windows over a
batch with holes in its padding, head dims other than 64, 96 and 128 – run on the torch
backend's path instead.
"""

from __future__ import annotations

import torch

from hf_paged_kv.kernels.paged_decode import choose_splits, paged_decode
from hf_paged_kv.kernels.paged_prefill import paged_prefill
from hf_paged_kv.kernels.triton_utils import unsupported
from hf_paged_kv.kernels.write_kv import write_kv

from ..step import to_device
from .torch_backend import TorchBackend


class TritonBackend:
    name = "triton"

    def __init__(self, pool):
        self.pool = pool
        self.fallback = TorchBackend(pool)

    def write(self, plan, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the forward's new K/V (`[B, kv_heads, T, head_dim]`) at the plan's slots."""
        write_kv(self.pool.key_cache[layer], self.pool.value_cache[layer],
                 key.transpose(1, 2), value.transpose(1, 2), plan.on("slot_mapping", key.device))

    def attention(self, query, layer: int, plan, scale: float, window=None, softcap=None, need_weights=False,
                  new_kv=None):
        """`query` `[B, heads, T, head_dim]` against the paged KV of `layer`; same shape out.
        `new_kv` is not used: the kernels read every key from the pool."""
        caches = self.pool.key_cache[layer], self.pool.value_cache[layer]
        # what the kernels do not implement (weights, windows over holes, head dims such as 16, 80 or 256,
        # mixed dtypes) runs on the torch backend, on the same device, instead of failing the forward
        if need_weights or (window is not None and plan.q_logical is not None) or unsupported(query, caches[0]):
            return self.fallback.attention(query, layer, plan, scale, window, softcap, need_weights)
        device = query.device
        tables, kv_lens, q_pos = (plan.on(name, device) for name in ("block_tables", "kv_lens", "q_pos"))
        if query.shape[0] == plan.num_sequences:  # one sequence per row
            batch, _, width, _ = query.shape
            if width == 1:
                return self._decode(query[:, :, 0], caches, plan, tables, kv_lens, q_pos, scale, window,
                                    softcap)[:, :, None], None
            q_pos = q_pos.view(batch, width)
            return paged_prefill(query, *caches, tables, kv_lens, q_pos, scale, window, softcap=softcap), None
        return self._packed(query, caches, plan, tables, kv_lens, q_pos, scale, window, softcap), None

    def _decode(self, query, caches, plan, tables, kv_lens, q_pos, scale, window, softcap):
        splits = choose_splits(query.shape[0], caches[0].shape[2], plan.max_kv_len, query.device)
        return paged_decode(query, *caches, tables, kv_lens, q_pos, scale, window, num_splits=splits, softcap=softcap)

    def _packed(self, query, caches, plan, tables, kv_lens, q_pos, scale, window, softcap):
        """The serving engine's packed row: decodes in one `paged_decode`, each prefill chunk
        in its own `paged_prefill`."""
        flat = query[0].transpose(0, 1)  # [Q, heads, dim]
        out = torch.empty_like(flat)
        decodes, chunks = plan.single_and_chunked
        if len(decodes):
            key = ("triton-decodes", query.device)  # the same for every layer: copied to the device once
            if key not in plan.memo:
                plan.memo[key] = to_device(plan.q_start[decodes], query.device), to_device(decodes, query.device)
            rows, picked = plan.memo[key]
            out[rows] = self._decode(flat[rows], caches, plan, tables[picked], kv_lens[picked], q_pos[rows], scale,
                                     window, softcap)
        for sequence in chunks.tolist():
            lo, hi = int(plan.q_start[sequence]), int(plan.q_start[sequence + 1])
            chunk = flat[lo:hi].transpose(0, 1)[None]
            out[lo:hi] = paged_prefill(chunk, *caches, tables[sequence : sequence + 1], kv_lens[sequence : sequence + 1],
                                       q_pos[lo:hi][None], scale, window, softcap=softcap)[0].transpose(0, 1)
        return out.transpose(0, 1)[None]
