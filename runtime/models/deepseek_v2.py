"""DeepSeek-V2: MLA attention like V3 (RoPE on interleaved pairs), softmax routing with greedy or
group_limited_greedy top-k, routed_scaling_factor, shared experts, first_k_dense_replace dense layers."""
from __future__ import annotations

from .attention import mla_attention, mla_cache_widths
from .routing import softmax_topk


def route(cfg, w: dict, p: str, x):
    return softmax_topk(cfg, x, w[p + "gate.weight"])


attention = mla_attention
cache_widths = mla_cache_widths
