"""DeepSeek-V3.2: DeepSeek-V3 (MLA, sigmoid group-limited routing, shared experts, dense first layers) whose attention
sees only the keys the lightning indexer selects per query (indexer.py); the per-request cache holds the indexer's
keys beside the MLA latent."""
from __future__ import annotations

from .attention import mla_attention, mla_cache_widths
from .deepseek_v3 import route

__all__ = ["attention", "cache_widths", "route"]


def attention(cfg, w, p, x, batch, layer, rope, cos, sin):
    return mla_attention(cfg, w, p, x, batch, layer, rope, cos, sin, indexed=True)


def cache_widths(cfg):
    return mla_cache_widths(cfg, indexed=True)
