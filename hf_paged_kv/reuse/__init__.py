"""Cross-request KV reuse: the exact block-hash prefix index and the semantic candidate index."""

from .prefix_index import PUBLIC_TENANT, PrefixIndex
from .semantic import SemanticIndex

__all__ = ["PrefixIndex", "SemanticIndex", "PUBLIC_TENANT"]
