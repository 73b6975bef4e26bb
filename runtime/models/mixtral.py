"""Mixtral: GQA attention (optional sliding window), softmax top-2 routing renormalized over the chosen experts.
Hub checkpoints name the MoE block `block_sparse_moe`."""
from __future__ import annotations

from .attention import gqa_attention, gqa_cache_widths
from .routing import softmax_topk


def route(cfg, w: dict, p: str, x):
    return softmax_topk(cfg, x, w[p + "gate.weight"])


def attention(cfg, w, p, x, batch, layer, rope, cos, sin):
    return gqa_attention(cfg, w, p, x, batch, layer, rope, cos, sin, qk_norm=None)


cache_widths = gqa_cache_widths
