"""MiniMax-M2: GQA attention with q/k RMSNorm over the whole projection and partial rotary, sigmoid top-k routing
with the block's e_score_correction_bias (beside the router, not inside it), weights renormalized, no shared
experts. Hub checkpoints name the MoE block `block_sparse_moe`."""
from __future__ import annotations

from .attention import gqa_attention, gqa_cache_widths
from .routing import sigmoid_grouped


def route(cfg, w: dict, p: str, x):
    """p: 'model.layers.N.block_sparse_moe.' -> (ids (T, k), weights (T, k))."""
    return sigmoid_grouped(cfg, x, w[p + "gate.weight"], w.get(p + "e_score_correction_bias"))


def attention(cfg, w, p, x, batch, layer, rope, cos, sin):
    return gqa_attention(cfg, w, p, x, batch, layer, rope, cos, sin,
                         qk_norm=cfg.qk_norm_scope if cfg.qk_norm else None)


cache_widths = gqa_cache_widths
