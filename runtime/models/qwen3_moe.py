"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k routing (renormalized when norm_topk_prob), no shared
experts; mlp_only_layers / decoder_sparse_step choose the dense layers."""
from __future__ import annotations

from .attention import gqa_attention, gqa_cache_widths
from .routing import softmax_topk


def route(cfg, w: dict, p: str, x):
    return softmax_topk(cfg, x, w[p + "gate.weight"])


def attention(cfg, w, p, x, batch, layer, rope, cos, sin):
    return gqa_attention(cfg, w, p, x, batch, layer, rope, cos, sin, qk_norm="head")


cache_widths = gqa_cache_widths
