"""DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): which earlier tokens each query's MLA attention
may see.

Per token (all in float32 for the scores, as the reference computes them):
  q_idx = wq_b(q_resid)               (T, Hi, Di)   q_resid: the MLA's normalized q LoRA activations
  k_idx = LayerNorm(wk(x))            (T, Di)       cached per position beside the MLA latent (SeqCache tensor 1)
  both roped on their first qk_rope_head_dim dims in the halves layout (the MLA itself ropes interleaved pairs;
  GLM-5's indexer ropes pairs too: cfg.index_rope_interleaved), with the model's cos/sin (YaRN factor included)
  w     = weights_proj(x) * Hi^-0.5   (T, Hi)
  score(t, s) = sum_h w[t, h] * relu(q_idx[t, h] . k_idx[s]) * Di^-0.5
Each query keeps the index_topk visible keys with the highest scores (every visible key while there are at most
index_topk of them), and the MLA softmax runs over those only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from ktlayouts.families import ModelConfig

from ..ops.packed_linear import linear
from .choices import top_k
from .layers import Rope

K_NORM_EPS = 1e-6      # the indexer's LayerNorm(index_head_dim, eps=1e-6)


@dataclass
class IndexerInputs:
    q: torch.Tensor          # (T, Hi, Di) float32
    k: torch.Tensor          # (T, Di) in the cache dtype: what the cache stores
    weights: torch.Tensor    # (T, Hi) float32, Hi^-0.5 folded in


def cache_width(cfg: ModelConfig) -> tuple[int, ...]:
    return (cfg.index_head_dim,)


def project(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, q_resid: torch.Tensor, rope: Rope,
            cos: torch.Tensor, sin: torch.Tensor) -> IndexerInputs:
    """x: (T, H) and q_resid: (T, q_lora_rank) -> the indexer's queries, keys and head weights.
    p: the layer's self_attn prefix; the indexer's tensors are under p + 'indexer.'."""
    T, hi, di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
    ip = p + "indexer."
    q = linear(q_resid, w[ip + "wq_b.weight"]).view(T, hi, di)
    k = linear(x, w[ip + "wk.weight"])
    k = F.layer_norm(k.float(), (di,), w[ip + "k_norm.weight"].float(), w[ip + "k_norm.bias"].float(),
                     K_NORM_EPS).to(x.dtype)
    # V3.2 ropes halves although its MLA ropes pairs; GLM-5 ropes pairs in both
    q = rope.apply(q, cos, sin, interleaved=cfg.index_rope_interleaved)
    k = rope.apply(k[:, None], cos, sin, interleaved=cfg.index_rope_interleaved)[:, 0]
    wp = w[ip + "weights_proj.weight"]          # a tensor (float32 math, as transformers) or a quantized Linear
    weights = linear(x.float(), wp.float() if isinstance(wp, torch.Tensor) else wp).float() * hi ** -0.5
    return IndexerInputs(q.float(), k, weights)


def select(cfg: ModelConfig, q: torch.Tensor, k_all: torch.Tensor, weights: torch.Tensor,
           visible: torch.Tensor | None) -> torch.Tensor | None:
    """The keys one request's n new queries attend to.  q: (n, Hi, Di), weights: (n, Hi) of its queries;
    k_all: (S, Di) its cached keys, S = start + n; visible: (n, S) bool (None: all visible) -> (n, S) bool, or None
    when every query sees at most index_topk keys (nothing to drop)."""
    n, S = q.shape[0], k_all.shape[0]
    if S <= cfg.index_topk:
        return visible
    scores = torch.einsum("thd,sd->ths", q, k_all.float()) * cfg.index_head_dim ** -0.5        # (n, Hi, S)
    index = torch.einsum("th,ths->ts", weights, F.relu(scores))                                # (n, S)
    if visible is not None:
        index = index.masked_fill(~visible, float("-inf"))
    top = top_k("indexer", index, cfg.index_topk)                                              # (n, topk)
    keep = torch.zeros((n, S), dtype=torch.bool, device=q.device).scatter_(1, top, True)
    return keep if visible is None else keep & visible
