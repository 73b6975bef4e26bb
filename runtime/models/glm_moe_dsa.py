"""GLM-5 / 5.1 / 5.2: DeepSeek-V3.2's MLA with the lightning indexer (indexer.py; GLM's ropes interleaved pairs, as
cfg.index_rope_interleaved says) and DeepSeek-V3's sigmoid group-limited routing with shared experts. New here only
index sharing (GLM-5.2): a layer cfg.indexer_types calls "shared" runs no indexer and attends to the keys the
previous "full" layer of the same forward selected for each query, carried on the batch (Batch.carried). Its KV
blocks keep the indexer-key slot every layer has (the pool's widths are per model), unwritten."""
from __future__ import annotations

import torch
from ktlayouts.families import ModelConfig

from .attention import mla_attention, mla_cache_widths
from .kv_cache import Batch
from .layers import Rope
from .routing import sigmoid_grouped

__all__ = ["attention", "cache_widths", "route"]
CARRY = "indexer_selections"      # Batch.carried key: per request, the last full layer's (n, S) keep mask


def route(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor):
    """p: 'model.layers.N.mlp.' -> (ids (T, k), weights (T, k))."""
    return sigmoid_grouped(cfg, x, w[p + "gate.weight"], w.get(p + "gate.e_score_correction_bias"))


def attention(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int, rope: Rope,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H) -> (T, H)."""
    if not cfg.indexer_types:                   # every layer selects its own keys (GLM-5, GLM-5.1)
        return mla_attention(cfg, w, p, x, batch, layer, rope, cos, sin, indexed=True)
    full = cfg.indexer_types[layer] == "full"
    carried = batch.carried.setdefault(CARRY, [])
    if not full and len(carried) != len(batch.seqs):
        raise RuntimeError(f"layer {layer} shares the indexer selection of an earlier full layer, but none ran in "
                           f"this forward")
    return mla_attention(cfg, w, p, x, batch, layer, rope, cos, sin, indexed=full, selections=carried)


def cache_widths(cfg: ModelConfig) -> list[tuple[int, ...]]:
    return mla_cache_widths(cfg, indexed=True)
