"""Prefix cache across requests: full KV blocks keyed by their token prefix, shared read-only on the compute device,
evicted to a CPU RAM tier and then to a disk tier that survives restarts (cache.py has the whole story)."""
from .cache import TIERS, PrefixCache, PrefixCacheConfig
from .disk_tier import DiskTierError

__all__ = ["TIERS", "DiskTierError", "PrefixCache", "PrefixCacheConfig"]
