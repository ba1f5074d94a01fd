"""Memory tiers below the device pool: host memory (and, later, disk)."""

from .host import HostTier

__all__ = ["HostTier"]
