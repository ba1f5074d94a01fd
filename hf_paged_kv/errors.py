"""The project's error types: every failure a user can meet is one of these, with a message that
says what went wrong and what to do."""


class PagedKVError(RuntimeError):
    """Base class of every error raised by hf_paged_kv."""


class PoolExhaustedError(PagedKVError):
    """A forward needs more free blocks than the pool has.

    Raised before anything is written: the cache and the pool are exactly as they were, other
    caches keep working, and the request can be retried once blocks are released (or with a
    larger pool).
    """

    def __init__(self, needed: int, free: int, num_blocks: int):
        self.needed, self.free, self.num_blocks = needed, free, num_blocks
        super().__init__(
            f"KV pool exhausted: this forward needs {needed} more block(s) but only {free} of "
            f"{num_blocks} are free or evictable. Release finished caches (`cache.release()` or a `with` block), "
            "or give the model a larger pool: "
            "`hf_paged_kv.disable(model)`, then `hf_paged_kv.enable(model, pool=KVPool(num_blocks=...))`."
        )


class NotEnabledError(PagedKVError):
    """A PagedCache was used with a model on which `hf_paged_kv.enable(model)` was not called."""


class CacheReleasedError(PagedKVError):
    """A PagedCache was used after `release()`."""


class UnsupportedModelError(PagedKVError):
    """The model uses an attention feature the paged backend cannot reproduce exactly."""


class Overloaded(PagedKVError):
    """The serving engine is shedding load; retry after `retry_after` seconds."""

    def __init__(self, retry_after: float, why: str):
        self.retry_after = retry_after
        super().__init__(f"{why}; retry after {retry_after:.1f} s")
