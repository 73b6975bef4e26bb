"""Qwen3.5-MoE: Qwen3-Next's forward (qwen3_next.py) with the DeltaNet's input projections as four plain Linears
(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). Its interleaved M-RoPE is plain partial RoPE for text (the three
position streams carry the same position), so gated attention, routing, the shared expert's gate, the zero-centred
RMSNorm and the cache layout are Qwen3-Next's own."""
from __future__ import annotations

from .linear_attention import gated_deltanet, project_split
from .qwen3_next import (
    cache_layers,
    cache_widths,
    gated_attention,
    recurrent_state,
    rms_norm,
    route,
    shared_expert_scale,
)

__all__ = ["attention", "cache_layers", "cache_widths", "recurrent_state", "rms_norm", "route",
           "shared_expert_scale"]


def attention(cfg, w, p, x, batch, layer, rope, cos, sin):
    """p: '<root>layers.N.self_attn.'; linear layers live under '<root>layers.N.linear_attn.'."""
    if cfg.layer_types[layer] == "linear_attention":
        return gated_deltanet(cfg, w, p[: -len("self_attn.")] + "linear_attn.", x, batch, layer, project_split)
    return gated_attention(cfg, w, p, x, batch, layer, rope, cos, sin)
