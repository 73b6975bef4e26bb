"""DeepSeek-V3 / Kimi-K2 / Kimi-K2.5's text model / GLM-4.7-Flash: MLA attention (q/kv LoRA, decoupled YaRN RoPE,
compressed-latent cache), sigmoid routing with e_score_correction_bias and group-limited top-k,
routed_scaling_factor, shared experts, dense first layers."""
from __future__ import annotations

from .attention import mla_attention, mla_cache_widths
from .routing import sigmoid_grouped


def route(cfg, w: dict, p: str, x):
    """p: 'model.layers.N.mlp.' -> (ids (T, k), weights (T, k))."""
    return sigmoid_grouped(cfg, x, w[p + "gate.weight"], w.get(p + "gate.e_score_correction_bias"))


attention = mla_attention
cache_widths = mla_cache_widths
