"""hf_paged_kv: a paged KV cache for Hugging Face `generate`.

    import hf_paged_kv
    from hf_paged_kv import PagedCache

    hf_paged_kv.enable(model)
    out = model.generate(**inputs, past_key_values=PagedCache())
"""

from .pool import advise_block_size
from .cache.paged_cache import PagedCache
from .engine import SLO, Engine, EngineConfig, Limits, RequestFailed, RequestHandle, Thresholds
from .errors import (
    CacheReleasedError,
    NotEnabledError,
    Overloaded,
    PagedKVError,
    PoolExhaustedError,
    UnsupportedModelError,
)
from .integration.hooks import disable, enable, is_enabled, pool_of
from .integration.pipeline import pipeline
from .pool import KVPool
from .reuse.prefixes import cached_tokens, persist, pin, publish, unpin
from .reuse import SemanticIndex
from .reuse.pins import PinBudgetError

__all__ = [
    "enable",
    "disable",
    "is_enabled",
    "pool_of",
    "publish",
    "pin",
    "unpin",
    "persist",
    "cached_tokens",
    "advise_block_size",
    "PinBudgetError",
    "pipeline",
    "PagedCache",
    "KVPool",
    "Engine",
    "EngineConfig",
    "RequestHandle",
    "RequestFailed",
    "SLO",
    "Limits",
    "Thresholds",
    "Overloaded",
    "SemanticIndex",
    "PagedKVError",
    "PoolExhaustedError",
    "NotEnabledError",
    "CacheReleasedError",
    "UnsupportedModelError",
]
__version__ = "0.2.0"
