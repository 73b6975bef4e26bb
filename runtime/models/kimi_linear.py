"""Kimi Linear: Kimi Delta Attention (kda.py) in most layers, MLA without RoPE in the others (mla_attention with an
identity rotary: the qk_rope_head_dim part of the keys is shared across heads but never rotated); DeepSeek-V3's
sigmoid routing with e_score_correction_bias, shared experts, dense first layers. MLA layers use the KV blocks
(their compressed latents), KDA layers SeqCache.recurrent."""
from __future__ import annotations

import torch
from ktlayouts.families import ModelConfig

from .attention import mla_attention, mla_cache_widths
from .kda import kda_attention
from .kv_cache import StateLayout
from .linear_attention import state_shapes
from .routing import sigmoid_grouped


class NoRope:
    """The rotary of a NoPE MLA layer: positions leave q and k as they are."""

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool | None = None) -> torch.Tensor:
        return x


NOPE = NoRope()


def route(cfg, w: dict, p: str, x):
    """p: 'model.layers.N.block_sparse_moe.' -> (ids (T, k), weights (T, k))."""
    return sigmoid_grouped(cfg, x, w[p + "gate.weight"], w.get(p + "gate.e_score_correction_bias"))


def attention(cfg: ModelConfig, w, p, x, batch, layer, rope, cos, sin):
    if cfg.layer_types[layer] == "linear_attention":
        return kda_attention(cfg, w, p, x, batch, layer)
    slot = cfg.layer_types[:layer].count("full_attention")          # this layer's KV slot (cache_layers)
    return mla_attention(cfg, w, p, x, batch, slot, NOPE, cos, sin)


cache_widths = mla_cache_widths    # the MLA layers' compressed latent + shared key per position


def cache_layers(cfg) -> int:
    """KV blocks only for the MLA layers (the KDA layers keep SeqCache.recurrent instead)."""
    return cfg.layer_types.count("full_attention")


def recurrent_state(cfg, dtype: torch.dtype) -> StateLayout:
    """The per-request state of the KDA layers: the conv window in the dense dtype, S (heads, dk, dv) in float32."""
    layers = tuple(i for i, t in enumerate(cfg.layer_types) if t == "linear_attention")
    return StateLayout(layers, state_shapes(cfg), (dtype, torch.float32))
