"""GLM-4.5 / 4.6 / 4.7: GQA attention with partial rotary, optional per-head q/k RMSNorm and q/k/v bias, sigmoid
group-limited routing with e_score_correction_bias, shared experts, first_k_dense_replace dense layers."""
from __future__ import annotations

from .attention import gqa_attention, gqa_cache_widths
from .routing import sigmoid_grouped


def route(cfg, w: dict, p: str, x):
    """p: 'model.layers.N.mlp.' -> (ids (T, k), weights (T, k))."""
    return sigmoid_grouped(cfg, x, w[p + "gate.weight"], w.get(p + "gate.e_score_correction_bias"))


def attention(cfg, w, p, x, batch, layer, rope, cos, sin):
    return gqa_attention(cfg, w, p, x, batch, layer, rope, cos, sin, qk_norm="head" if cfg.qk_norm else None)


cache_widths = gqa_cache_widths
