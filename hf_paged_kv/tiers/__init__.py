"""Memory tiers below the device pool: host memory and disk."""

from .disk import DiskTier
from .host import HostTier

__all__ = ["HostTier", "DiskTier"]
