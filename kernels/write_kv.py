"""Triton `write_kv`: scatter new tokens' K and V into their pool slots.

One program per token: it copies the token's `[kv_heads, head_dim]` K and V rows to slot
`slot_mapping[token]` (`block * block_size + offset`); a negative slot (a pad token, or a row
that shares another row's prompt) writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_utils import Launch, padded_head_dim


@triton.jit
def _write_kv_kernel(
    key, value, key_cache, value_cache, slot_mapping,
    num_tokens_per_row,
    s_kb, s_kt, s_kh, s_kd,  # strides of key/value [B, T, kv_heads, head_dim]
    s_cb, s_cs, s_ch, s_cd,  # strides of the caches [blocks, block_size, kv_heads, head_dim]
    BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    row, col = token // num_tokens_per_row, token % num_tokens_per_row
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    inside = (heads < KV_HEADS) & (dims < HEAD_DIM)
    src = row * s_kb + col * s_kt + heads * s_kh + dims * s_kd
    block = slot // BLOCK_SIZE
    dst = block * s_cb + (slot % BLOCK_SIZE) * s_cs + heads * s_ch + dims * s_cd
    write = inside & (slot >= 0)
    tl.store(key_cache + dst, tl.load(key + src, mask=write, other=0.0), mask=write)
    tl.store(value_cache + dst, tl.load(value + src, mask=write, other=0.0), mask=write)


def write_kv(key_cache, value_cache, key, value, slot_mapping) -> None:
    """Same contract as `reference.write_kv`; `key`/`value` are `[N, kv_heads, head_dim]` or
    `[B, T, kv_heads, head_dim]` (any strides) and `slot_mapping` has their leading shape."""
    launch = write_kv_launch(key_cache, value_cache, key, value, slot_mapping)
    if launch is not None:  # nothing to write
        launch.run()


def write_kv_launch(key_cache, value_cache, key, value, slot_mapping) -> Launch | None:
    """The kernel launch of one `write_kv` call; None when there is no token to write."""
    if key.dim() == 3:
        key, value, slot_mapping = key[None], value[None], slot_mapping[None]
    return WriteSetup.build(key_cache, key, slot_mapping).launch(key_cache, value_cache, key, value)


@dataclass(frozen=True)
class WriteSetup:
    """What the `write_kv` launches of every layer of one forward share (the slots in the
    kernel's form, the compile-time constants): built once per forward, see `DecodeSetup`."""

    slots: torch.Tensor  # int64, contiguous, one per token
    tokens_per_row: int
    constexprs: dict

    @classmethod
    def build(cls, key_cache, key, slot_mapping) -> WriteSetup:
        """For new K/V shaped as `key` (`[B, T, kv_heads, head_dim]`) and caches as `key_cache`."""
        _, tokens, kv_heads, head_dim = key.shape
        return cls(
            slots=slot_mapping.reshape(-1).to(torch.int64).contiguous(), tokens_per_row=tokens,
            constexprs=dict(
                BLOCK_SIZE=key_cache.shape[1], KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                HEAD_DIM_PAD=padded_head_dim(head_dim), HEADS_PAD=triton.next_power_of_2(kv_heads),
            ),
        )

    def launch(self, key_cache, value_cache, key, value) -> Launch | None:
        """The launch of one layer; None when there is no token to write."""
        if self.slots.numel() == 0:
            return None
        if key.dtype != key_cache.dtype:
            key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
        if value.stride() != key.stride():  # the kernel addresses both with one set of strides
            key, value = key.contiguous(), value.contiguous()
        assert key_cache.stride() == value_cache.stride()
        return Launch(
            _write_kv_kernel, (self.slots.numel(),),
            (key, value, key_cache, value_cache, self.slots, self.tokens_per_row, *key.stride(), *key_cache.stride()),
            self.constexprs,
        )
