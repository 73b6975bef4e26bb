"""The forward of every family built from known layer kinds, chosen by its ModelConfig (the family file's data):

- attention: `cfg.attention` "mla" (DeepSeek latent attention; with DeepSeek-V3.2's lightning indexer when
  `cfg.index_topk` is set) or "gqa" (q/k RMSNorm when `cfg.qk_norm`, over each head or the whole projection as
  `cfg.qk_norm_scope` says; a sliding window from `cfg.sliding_window`, per layer when `cfg.layer_types` names
  "sliding_attention" / "full_attention"; a sink logit per head when `cfg.attention_sinks`);
- router: `cfg.scoring` "sigmoid" (group-limited top-k over sigmoid scores plus the e_score_correction_bias, where
  the checkpoint has one) or "softmax" (greedy / group_limited_greedy top-k of softmax scores).

Families with new math keep a module of their own (Qwen3-Next's gated attention and DeltaNet, gpt-oss's router
over biased logits): `Family.runtime_module` names it.
"""
from __future__ import annotations

import torch
from ktlayouts.families import ModelConfig

from .attention import gqa_attention, gqa_cache_widths, mla_attention, mla_cache_widths
from .kv_cache import Batch
from .layers import Rope
from .routing import sigmoid_grouped, softmax_topk

# where checkpoints keep the sigmoid router's correction bias, inside the MoE block: in the router (DeepSeek-V3,
# GLM-4.5) or beside it (MiniMax-M2)
CORRECTION_BIAS = ("gate.e_score_correction_bias", "e_score_correction_bias")


def route(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor):
    """p: 'model.layers.N.mlp.', x: (T, H) -> (ids (T, k) int64, weights (T, k) float32)."""
    if cfg.scoring == "sigmoid":
        bias = next((w[p + b] for b in CORRECTION_BIAS if p + b in w), None)
        return sigmoid_grouped(cfg, x, w[p + "gate.weight"], bias)
    return softmax_topk(cfg, x, w[p + "gate.weight"])


def window(cfg: ModelConfig, layer: int) -> int | None:
    """Keys a query of this layer sees (None: all of them)."""
    if cfg.layer_types and cfg.layer_types[layer] in ("sliding_attention", "full_attention"):
        return cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else None
    return cfg.sliding_window


def attention(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int, rope: Rope,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """p: 'model.layers.N.self_attn.', x: (T, H) -> (T, H)."""
    if cfg.is_mla:
        return mla_attention(cfg, w, p, x, batch, layer, rope, cos, sin, indexed=cfg.index_topk is not None)
    return gqa_attention(cfg, w, p, x, batch, layer, rope, cos, sin, qk_norm=cfg.qk_norm_scope if cfg.qk_norm else None,
                         window=window(cfg, layer), sinks=w[p + "sinks"] if cfg.attention_sinks else None)


def cache_widths(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """Per layer, the widths of what the KV blocks hold: MLA's latent (+ the indexer's keys), or GQA's k and v."""
    return mla_cache_widths(cfg, indexed=cfg.index_topk is not None) if cfg.is_mla else gqa_cache_widths(cfg)
