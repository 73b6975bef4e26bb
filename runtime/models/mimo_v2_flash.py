"""MiMo-V2-Flash: GQA whose two layer kinds differ (ktlayouts.families.mimo_v2_flash). Sliding-window layers have
cfg.sliding_attention's kv heads, RoPE (its own theta) and sinks; full layers cfg.num_kv_heads, cfg.rope and sinks
when cfg.attention_sinks. Queries and keys have head_dim dims, values v_head_dim; values are scaled by
cfg.value_scale before they are cached, as the reference does. Router: sigmoid noaux_tc (routing.sigmoid_grouped).

The KV blocks have one width for every layer: max(full, sliding) kv heads, k (heads, head_dim) and v (heads,
v_head_dim). The kind with fewer kv heads (the full layers in the release: 4 against 8) stores each head repeated
(kv head j in slots j*r .. j*r + r - 1), which gives every query head the same keys and values as the reference's
grouping; it costs those layers r times their KV bytes (in the release 9 of 48 layers, ~10% of the cache).
"""
from __future__ import annotations

import torch
from ktlayouts.families import ModelConfig

from ..ops.packed_linear import linear
from .attention import gqa_attend
from .kv_cache import Batch
from .layers import Rope
from .routing import sigmoid_grouped

_ROPES: dict = {}        # (RopeConfig, device) -> Rope of the sliding layers (its cos/sin table is kept there)


def cache_kv_heads(cfg: ModelConfig) -> int:
    return max(cfg.num_kv_heads, cfg.sliding_attention.num_kv_heads)


def cache_widths(cfg: ModelConfig) -> list[tuple[int, ...]]:
    n = cache_kv_heads(cfg)
    return [(n, cfg.head_dim), (n, cfg.v_head_dim)]


def route(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor):
    """p: 'model.layers.N.mlp.', x: (T, H) -> (ids (T, k), weights (T, k))."""
    return sigmoid_grouped(cfg, x, w[p + "gate.weight"], w.get(p + "gate.e_score_correction_bias"))


def _sliding_cos_sin(cfg: ModelConfig, batch: Batch, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    key = (cfg.sliding_attention.rope, x.device)
    rope = _ROPES.get(key)
    if rope is None:
        rope = _ROPES[key] = Rope(cfg.sliding_attention.rope, x.device)
    return rope.cos_sin(batch.positions.to(x.device), x.dtype)


def attention(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int, rope: Rope,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """p: 'model.layers.N.self_attn.', x: (T, H) -> (T, H). cos/sin: the full layers' (cfg.rope)."""
    T, nh, hd, vd = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.v_head_dim
    sliding = cfg.layer_types[layer] == "sliding_attention"
    nkv = cfg.sliding_attention.num_kv_heads if sliding else cfg.num_kv_heads
    q = linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias")).view(T, nh, hd)
    k = linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias")).view(T, nkv, hd)
    v = linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias")).view(T, nkv, vd) * cfg.value_scale
    if sliding:
        cos, sin = _sliding_cos_sin(cfg, batch, x)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)       # the first rope.dim dims of each head
    rep = cache_kv_heads(cfg) // nkv
    if rep > 1:                                                   # (T, nkv, d) -> (T, nkv * rep, d)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    has_sinks = cfg.sliding_attention.sinks if sliding else cfg.attention_sinks
    out = gqa_attend(cfg, q, k, v, batch, layer, window=cfg.sliding_window if sliding else None,
                     sinks=w[p + "attention_sink_bias"] if has_sinks else None)                  # (T, nh, vd)
    return linear(out.reshape(T, nh * vd), w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))
