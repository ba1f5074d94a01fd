"""hf_paged_kv: a paged KV cache for Hugging Face `generate`.

    import hf_paged_kv
    from hf_paged_kv import PagedCache

    hf_paged_kv.enable(model)
    out = model.generate(**inputs, past_key_values=PagedCache())
"""

from .attention import disable, enable, persist, pin, pool_of, publish, unpin
from .cache import PagedCache
from .errors import CacheReleasedError, NotEnabledError, PagedKVError, PoolExhaustedError, UnsupportedModelError
from .pinning import PinBudgetError
from .pipeline import pipeline
from .pool import KVPool
from .reuse import SemanticIndex

__all__ = [
    "enable",
    "disable",
    "pool_of",
    "publish",
    "pin",
    "unpin",
    "persist",
    "PinBudgetError",
    "pipeline",
    "PagedCache",
    "KVPool",
    "SemanticIndex",
    "PagedKVError",
    "PoolExhaustedError",
    "NotEnabledError",
    "CacheReleasedError",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
