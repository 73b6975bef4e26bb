"""Qwen3-Next: gated DeltaNet linear attention (linear_attention.py) in most layers, gated full attention in every
full_attention_interval-th; Qwen3-MoE routing plus one shared expert scaled by sigmoid(shared_expert_gate); every
decoder RMSNorm scales by (1 + weight). Full-attention layers use the KV blocks, linear ones SeqCache.recurrent."""
from __future__ import annotations

import torch
from ktlayouts.families import ModelConfig

from ..ops.packed_linear import linear
from .attention import gqa_attend, gqa_cache_widths
from .kv_cache import Batch, StateLayout
from .layers import Rope
from .linear_attention import gated_deltanet, state_shapes
from .routing import softmax_topk


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: normalize and scale by (1 + weight) in float32, then cast (the reference's order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def route(cfg, w: dict, p: str, x):
    return softmax_topk(cfg, x, w[p + "gate.weight"])


def shared_expert_scale(cfg, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    """p: 'model.layers.N.mlp.' -> (T, 1): sigmoid(shared_expert_gate x), the shared expert's weight."""
    gate = w[p + "shared_expert_gate.weight"]                    # a router-kind tensor: may be kept in float32
    return torch.sigmoid(linear(x, gate.to(x.dtype) if isinstance(gate, torch.Tensor) else gate))


def gated_attention(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int, rope: Rope,
                    cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H) -> (T, H). q_proj yields per head [q (hd), output gate (hd)]; RoPE on the first rope.dim dims."""
    T, nh, nkv, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias")).view(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
    k = linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias")).view(T, nkv, hd)
    v = linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias")).view(T, nkv, hd)
    q, k = rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps), rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps)
    rd = cfg.rope.dim
    q = torch.cat([rope.apply(q[..., :rd], cos, sin), q[..., rd:]], dim=-1)
    k = torch.cat([rope.apply(k[..., :rd], cos, sin), k[..., rd:]], dim=-1)
    slot = cfg.layer_types[:layer].count("full_attention")                  # this layer's KV slot (cache_layers)
    out = gqa_attend(cfg, q, k, v, batch, slot).reshape(T, nh * hd) * torch.sigmoid(gate)
    return linear(out, w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))


def attention(cfg, w, p, x, batch, layer, rope, cos, sin):
    """p: 'model.layers.N.self_attn.' (the decoder's name for the attention block); linear layers live under
    'model.layers.N.linear_attn.'."""
    if cfg.layer_types[layer] == "linear_attention":
        return gated_deltanet(cfg, w, p[: -len("self_attn.")] + "linear_attn.", x, batch, layer)
    return gated_attention(cfg, w, p, x, batch, layer, rope, cos, sin)


cache_widths = gqa_cache_widths    # full-attention layers' k and v


def cache_layers(cfg) -> int:
    """KV blocks only for the full-attention layers (the DeltaNet layers keep SeqCache.recurrent instead)."""
    return cfg.layer_types.count("full_attention")


def recurrent_state(cfg, dtype: torch.dtype) -> StateLayout:
    """The per-request state of the DeltaNet layers: the conv window in the dense dtype (the conv weights'), S in
    float32."""
    layers = tuple(i for i, t in enumerate(cfg.layer_types) if t == "linear_attention")
    return StateLayout(layers, state_shapes(cfg), (dtype, torch.float32))
