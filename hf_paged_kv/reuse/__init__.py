"""Cross-request KV reuse: the exact block-hash prefix index and the semantic candidate index."""

from .prefix_index import PUBLIC_TENANT, PrefixIndex

__all__ = ["PrefixIndex", "PUBLIC_TENANT"]
