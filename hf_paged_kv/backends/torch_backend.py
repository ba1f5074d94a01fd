"""The torch backend: the CPU default and the fallback wherever Triton does not apply, built on
`hf_paged_kv.kernels.reference`.

Reading paged KV costs a copy unless the keys lie in consecutive blocks: the allocator keeps
each sequence's blocks in one run where it can, and then the keys are a zero-copy view of the
pool (`[1, kv_heads, L, head_dim]` with the pool's strides), which SDPA reads directly. Decode
steps and prefill chunks of up to four rows read each sequence that way; a prefill into empty
rows attends the forward's own keys; fragmented sequences are gathered a block at a time, and
padded batches, attention weights and soft-capping gather every row into one padded batch.
In the serving engine's packed forward, the decodes are gathered into padded batches too (one
call for many costs less than one call each) and each prefill chunk attends on its own.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_paged_kv.kernels import reference

from ..cache.step import to_device


class TorchBackend:
    name = "torch"

    def __init__(self, pool):
        self.pool = pool

    # ---------------------------------------------------------------- write
    def write(self, plan, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the forward's new K/V (`[B, kv_heads, T, head_dim]`) at the plan's slots."""
        src, dst = self._write_indices(plan, key.device)
        if dst.numel() == 0:
            return
        rows, heads, dim = key.shape[0] * key.shape[2], key.shape[1], key.shape[3]
        flat_key = key.transpose(1, 2).reshape(rows, heads, dim)
        flat_value = value.transpose(1, 2).reshape(rows, heads, dim)
        if src is not None:  # only some queries are written (pads, stored or shared tokens)
            flat_key, flat_value = flat_key.index_select(0, src), flat_value.index_select(0, src)
        reference.store_kv(self.pool.key_cache[layer], self.pool.value_cache[layer], flat_key, flat_value, dst)

    @staticmethod
    def _write_indices(plan, device):
        """`(queries written or None for all, their slots)` on `device`, once per forward."""
        key = ("torch-write", device)
        if key not in plan.memo:
            src = np.flatnonzero(plan.slot_mapping >= 0)
            every = len(src) == len(plan.slot_mapping)
            plan.memo[key] = (None if every else to_device(src, device), to_device(plan.slot_mapping[src], device))
        return plan.memo[key]

    # ------------------------------------------------------------ attention
    def attention(self, query, layer: int, plan, scale: float, window=None, softcap=None, need_weights=False,
                  new_kv=None):
        """`query` `[B, heads, T, head_dim]` against the paged KV of `layer`; returns the output
        in the same shape, and the weights `[B, heads, T, max_kv_len]` when `need_weights`.
        `new_kv`: this forward's own keys and values, attended directly when they are every
        row's whole sequence (a prefill into empty rows), as DynamicCache does."""
        keys, values = self.pool.key_cache[layer], self.pool.value_cache[layer]
        if query.shape[0] != plan.num_sequences:  # the serving engine's packed row
            return self._packed(query, keys, values, plan, scale, window, softcap), None
        if need_weights or softcap:
            out, weights = self._padded(query, keys, values, plan, scale, window, softcap, explicit=True)
            return out, weights if need_weights else None
        if window is not None and plan.q_logical is not None:  # windows over padding gaps: the general mask
            return self._padded(query, keys, values, plan, scale, window)
        if new_kv is not None and new_kv[0].dtype == keys.dtype and self._only_new_keys(plan, query.shape[2], window):
            return reference.sdpa(query, *new_kv, None, scale, is_causal=query.shape[2] > 1), None
        if plan.decode_only:
            return self._decode(query, keys, values, plan, scale, window), None
        if query.shape[0] <= 4 and self._rows_in_place(plan, query.shape[2]):  # a prefill or chunk per row
            outputs = [self._attend_sequence(query[row : row + 1], keys, values, plan, row, scale, window)
                       for row in range(query.shape[0])]
            return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), None
        return self._padded(query, keys, values, plan, scale, window)

    @staticmethod
    def _only_new_keys(plan, width: int, window) -> bool:
        """Every row is real and holds exactly this forward's `width` tokens, nothing before them,
        and no window cuts them: the forward's keys are the row's whole sequence, in order (for a
        row that shares another's blocks, recomputed equal to the ones stored; the dtype check is
        the caller's), so attention needs no read of the pool."""
        key = ("torch-only-new", window)
        if key not in plan.memo:
            plan.memo[key] = ((window is None or width <= window) and bool((plan.kv_lens == width).all())
                              and _queries_are_row_tails(plan, width))
        return plan.memo[key]

    @staticmethod
    def _rows_in_place(plan, width: int) -> bool:
        """Every row's keys are one contiguous run and its queries are its last `width` tokens, all
        real: each row attends through a view, no gather."""
        key = "torch-rows-in-place"
        if key not in plan.memo:
            plan.memo[key] = bool((plan.contiguous >= 0).all()) and _queries_are_row_tails(plan, width)
        return plan.memo[key]

    def _decode(self, query, keys, values, plan, scale, window):
        """One query per sequence. Rows of one length in runs at a fixed stride (a batch the
        allocator spread evenly) are one strided view of the pool and one SDPA call; other
        contiguous rows are a view each; fragmented ones are gathered."""
        stride = self._row_stride(plan)
        if stride is not None:
            shape, strides, offset = self._strided_view(plan, stride, window, keys)
            seq_keys = keys.as_strided(shape, strides, keys.storage_offset() + offset).transpose(1, 2)
            seq_values = values.as_strided(shape, strides, values.storage_offset() + offset).transpose(1, 2)
            if seq_keys.dtype != query.dtype:
                seq_keys, seq_values = seq_keys.to(query.dtype), seq_values.to(query.dtype)
            return reference.sdpa(query, seq_keys, seq_values, None, scale)
        if (plan.contiguous < 0).all() and len(plan.kv_lens) > 1:
            return self._padded(query, keys, values, plan, scale, window)[0]
        outputs = [
            self._attend_sequence(query[row : row + 1], keys, values, plan, row, scale, window)
            for row in range(query.shape[0])
        ]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    @staticmethod
    def _row_stride(plan) -> int | None:
        """Blocks between consecutive rows when every row is one run of one length at a fixed
        stride (0 for a single row), else None."""
        key = "torch-row-stride"
        if key not in plan.memo:
            starts, lens = plan.contiguous, plan.kv_lens
            steps = np.diff(starts)
            regular = (starts >= 0).all() and (lens == lens[0]).all() and (len(steps) == 0 or (
                (steps == steps[0]).all() and steps[0] > 0))
            plan.memo[key] = (int(steps[0]) if len(steps) else 0) if regular else None
        return plan.memo[key]

    @staticmethod
    def _strided_view(plan, stride: int, window, cache: torch.Tensor) -> tuple:
        """`(shape, strides, offset in the tensor)` of `[rows, length, kv_heads, dim]`: every
        row's stored tokens (the last `window` of them with a sliding window) as one view of a
        layer's pool tensor, no copy; the same for every layer of the forward with these head
        shapes (the caller adds the tensor's own offset in the storage the pool's tensors share)."""
        heads, dim = cache.shape[-2:]
        key = ("torch-strided", window, heads, dim)
        if key not in plan.memo:
            length = int(plan.kv_lens[0])
            first = 0 if window is None else max(0, length - window)
            block = plan.block_size * heads * dim
            offset = int(plan.contiguous[0]) * block + first * heads * dim
            shape = (len(plan.kv_lens), length - first, heads, dim)
            plan.memo[key] = shape, (stride * block, heads * dim, dim, 1), offset
        return plan.memo[key]

    def _packed(self, query, keys, values, plan, scale, window, softcap):
        """Many sequences in one row (the serving engine): the decodes (one query each) attend
        together, each prefill chunk on its own."""
        flat = query[0].transpose(0, 1)  # [Q, heads, dim]
        out = torch.empty_like(flat)
        decodes, chunks = plan.single_and_chunked
        if len(decodes) > 1:
            self._decode_rows(flat, out, keys, values, plan, scale, window, softcap)
        else:  # a lone decode reads its sequence through a view where it can
            chunks = range(plan.num_sequences)
        starts = plan.q_start
        for sequence in chunks:
            lo, hi = int(starts[sequence]), int(starts[sequence + 1])
            rows = flat[lo:hi].transpose(0, 1)[None]  # [1, heads, n, dim]
            attended = self._attend_sequence(rows, keys, values, plan, int(sequence), scale, window, softcap)
            out[lo:hi] = attended[0].transpose(0, 1)
        return out.transpose(0, 1)[None]

    def _decode_rows(self, flat, out, keys, values, plan, scale, window, softcap):
        """The packed forward's decodes, gathered into padded batches and attended one batch per
        call (one call per sequence cost more than the copy: 4.1 s against 1.6 s of a SmolLM2
        engine run); `flat`/`out` `[Q, heads, dim]`."""
        for rows, tables, width, visible in _decode_groups(plan, window, keys, flat.dtype, softcap):
            query = flat.index_select(0, rows)[:, :, None]  # [n, heads, 1, dim]
            seq_keys = reference.gather(keys, tables, width).to(query.dtype)
            seq_values = reference.gather(values, tables, width).to(query.dtype)
            attended = reference.attend(query, seq_keys, seq_values, visible, scale, softcap)
            out.index_copy_(0, rows, attended[:, :, 0])

    def _attend_sequence(self, query, keys, values, plan, sequence: int, scale, window, softcap=None):
        """`query` `[1, heads, n, dim]`: the last `n` stored tokens of `sequence` (causal)."""
        length, count = int(plan.kv_lens[sequence]), query.shape[2]
        first = 0 if window is None else max(0, length - count + 1 - window)
        seq_keys, seq_values = self._sequence_kv(keys, values, plan, sequence, first, length, query.dtype)
        if not softcap and (count == 1 or (count == length and (window is None or length <= window))):
            return reference.sdpa(query, seq_keys, seq_values, None, scale, is_causal=count > 1)
        visible = self._causal_mask(plan, query, first, length, window, softcap)
        return reference.attend(query, seq_keys, seq_values, visible, scale, softcap)

    @staticmethod
    def _causal_mask(plan, query, first: int, length: int, window, softcap) -> torch.Tensor:
        """`[1, 1, count, length - first]`: which of keys first..length each of the last `count`
        queries sees, boolean for soft-capped scores, else additive in the query's dtype; built
        once per forward (every layer asks for the same)."""
        device, count = query.device, query.shape[2]
        key = ("torch-causal", device, query.dtype, first, length, count, window, bool(softcap))
        if key not in plan.memo:
            key_positions = torch.arange(first, length, device=device)[None, :]
            positions = torch.arange(length - count, length, device=device)[:, None]
            visible = key_positions <= positions
            if window is not None:
                visible &= key_positions > positions - window
            visible = visible[None, None]
            plan.memo[key] = visible if softcap else reference.additive_mask(visible, query.dtype)
        return plan.memo[key]

    @staticmethod
    def _sequence_kv(keys, values, plan, sequence: int, first: int, length: int, dtype):
        """Keys and values `[1, kv_heads, length - first, dim]` of stored tokens first..length."""
        size = plan.block_size
        start = int(plan.contiguous[sequence])
        if start >= 0:
            lo, hi = start * size + first, start * size + length
            heads, dim = keys.shape[-2:]
            return tuple(cache.view(-1, heads, dim)[lo:hi].unsqueeze(0).transpose(1, 2).to(dtype)
                         for cache in (keys, values))
        tables = plan.on("block_tables", keys.device)[sequence : sequence + 1]
        return tuple(reference.gather(cache, tables, length, first).to(dtype) for cache in (keys, values))

    def _padded(self, query, keys, values, plan, scale, window, softcap=None, explicit=False):
        """Every row's keys gathered into one padded batch, one SDPA (or explicit) call with a
        mask built from the plan; the general path."""
        device, (batch, _, width, _) = query.device, query.shape
        length = max(plan.max_kv_len, 1)
        memo = ("torch-padded", device, window, width)
        if memo not in plan.memo:
            plan.memo[memo] = self._mask(plan, device, batch, width, length, window)
        mask, causal = plan.memo[memo]
        tables = plan.on("block_tables", device)
        seq_keys = reference.gather(keys, tables, length).to(query.dtype)
        seq_values = reference.gather(values, tables, length).to(query.dtype)
        if explicit:
            if mask is None:
                mask = reference.attention_mask(plan.on("q_pos", device).view(batch, width),
                                                plan.on("kv_lens", device), length, window)
            return reference.eager_attention(query, seq_keys, seq_values, mask, scale, softcap)
        return reference.sdpa(query, seq_keys, seq_values, mask, scale, is_causal=causal), None

    @staticmethod
    def _mask(plan, device, batch, width, length, window):
        """`(mask, is_causal)`: no mask when every row is real and of one length, as a standard
        decode step or a whole-prompt prefill."""
        standard = (plan.kv_lens == plan.kv_lens[0]).all() and _queries_are_row_tails(plan, width)
        window_is_moot = window is None or (length <= window and plan.q_logical is None)  # logical gaps count
        if standard and width in (1, length) and window_is_moot:
            return None, width > 1
        q_logical = plan.on("q_logical", device).view(batch, width) if plan.q_logical is not None else None
        k_logical = plan.on("k_logical", device) if plan.k_logical is not None else None
        mask = reference.attention_mask(plan.on("q_pos", device).view(batch, width), plan.on("kv_lens", device),
                                        length, window, q_logical, k_logical)
        return mask, False


def _queries_are_row_tails(plan, width: int) -> bool:
    """Each row's `width` queries are its last `width` stored tokens, all real (no pads);
    computed once per forward."""
    key = ("torch-row-tails", width)
    if key not in plan.memo:
        lens = plan.kv_lens.astype(np.int64)
        tails = plan.q_pos.reshape(len(lens), width) == lens[:, None] - width + np.arange(width)
        plan.memo[key] = bool(tails.all())
    return plan.memo[key]


GATHER_BYTES = 64 << 20  # the most one padded decode batch copies out of the pool, keys or values


def _decode_groups(plan, window, cache: torch.Tensor, dtype: torch.dtype, softcap) -> list[tuple]:
    """The packed forward's decodes in padded batches of similar widths. Each row reads from
    the block holding its first visible key (under a sliding window, not from block 0), so its
    width is the keys it reads plus less than a block. Sorted by width, a batch ends where its
    padded copy would pass `GATHER_BYTES` (so it bounds the memory a forward takes; the padding
    costs less than more calls: splitting where a row is under half the widest made the
    decodes of a SmolLM2 engine run about 1.5x slower). Per batch `(query rows, block tables from
    each row's first block, width, visible [n, 1, 1, width])`, on the pool's device, built once
    per forward; `visible` is boolean for soft-capped scores, else additive in `dtype`."""
    device = cache.device
    key = ("torch-decode-groups", device, window, dtype, bool(softcap))
    if key not in plan.memo:
        decodes = plan.single_and_chunked[0]
        lens = plan.kv_lens[decodes].astype(np.int64)
        firsts = np.zeros_like(lens) if window is None else np.maximum(lens - window, 0)
        skipped = firsts // plan.block_size  # leading blocks a row does not read
        widths = lens - skipped * plan.block_size
        order = np.argsort(-widths, kind="stable")
        token_bytes = cache[0, 0].numel() * cache.element_size()
        groups, start = [], 0
        while start < len(order):
            widest, end = int(widths[order[start]]), start + 1
            while end < len(order) and (end + 1 - start) * widest * token_bytes <= GATHER_BYTES:
                end += 1
            rows = order[start:end]
            reads = -(-widest // plan.block_size)  # blocks each row of the batch reads
            padded = np.pad(plan.block_tables[decodes[rows]], ((0, 0), (0, reads)), constant_values=-1)
            tables = np.take_along_axis(padded, skipped[rows, None] + np.arange(reads), axis=1)
            positions = np.arange(widest) + (skipped[rows] * plan.block_size)[:, None]
            visible = (positions >= firsts[rows, None]) & (positions < lens[rows, None])
            visible = to_device(visible, device)[:, None, None]
            groups.append((to_device(plan.q_start[decodes[rows]], device), to_device(tables, device), widest,
                           visible if softcap else reference.additive_mask(visible, dtype)))
            start = end
        plan.memo[key] = groups
    return plan.memo[key]
