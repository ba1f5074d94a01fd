"""The pool: one model's preallocated KV blocks (`KVPool`), their bookkeeping on the host
(`allocator`), sizing against the devices' memory (`sizing`), the one block-value policy that
chooses what leaves (`policy`), blocks coming back from lower tiers (`promotion`), and block size
advice (`advisor`)."""

from .advisor import Advice, advise_block_size
from .kv_pool import KVPool, LayerSpec

__all__ = ["KVPool", "LayerSpec", "Advice", "advise_block_size"]
