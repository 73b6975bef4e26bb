"""Attention over per-request caches: GQA (Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2) and MLA with a compressed-latent
cache (DeepSeek), optionally sparsified by DeepSeek-V3.2's lightning indexer (indexer.py).

Inputs are a flattened varlen batch: x (T, H) holds the new tokens of several requests; each request's queries see
only its own cache (plus its own new tokens, causally). Projections run once over all T rows; the score/softmax
part loops over requests (cheap next to the experts; no request can read another's cache). A request's cached
positions come as a few runs of views into the KV block pool (kv_cache.py): scores are computed per run and
concatenated, one softmax spans them all, and the output sums each run's share (one run: a single matmul each).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ktlayouts.families import ModelConfig

from ..packed_linear import dense_weight, linear
from . import indexer as lightning
from .kv_cache import Batch, causal_scores_mask
from .layers import Rope, rms_norm

LORA_NORM_EPS = 1e-6   # q_a_layernorm / kv_a_layernorm use the default eps in the reference, not rms_norm_eps


def _softmax_attend(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """scores: (heads, n, S) already scaled; mask (n, S) bool or None (all visible) -> probabilities."""
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


def _mask(s, device, window: int | None) -> torch.Tensor | None:
    """Causal (and sliding-window) mask of one request's new tokens; None when every key is visible (decode)."""
    if s.n == 1 and (window is None or s.start < window):
        return None
    return causal_scores_mask(s.n, s.start, s.start + s.n, device, window)


def _cat_scores(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _attend_runs(probs: torch.Tensor, values: list[torch.Tensor], apply) -> torch.Tensor:
    """sum over runs r of apply(probs[..., run r's positions], values[r]): the output of one softmax over runs."""
    if len(values) == 1:
        return apply(probs, values[0])
    out, off = None, 0
    for v in values:
        part = apply(probs[..., off:off + v.shape[0]], v)
        out, off = part if out is None else out + part, off + v.shape[0]
    return out


def gqa_cache_widths(cfg: ModelConfig) -> list[tuple[int, ...]]:
    return [(cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)]


def gqa_attention(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int, rope: Rope,
                  cos: torch.Tensor, sin: torch.Tensor, qk_norm: str | None) -> torch.Tensor:
    """x: (T, H) -> (T, H). p: weight-name prefix of this layer's self_attn, e.g. 'model.layers.3.self_attn.'.
    qk_norm: None, "head" (RMSNorm over each head's dims: Qwen3, GLM) or "projection" (over the whole q / k
    projection, all heads at once: MiniMax-M2), before RoPE. RoPE covers the first rope.dim dims of each head."""
    T, nh, nkv, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias"))                          # (T, nh*hd)
    k = linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias"))                          # (T, nkv*hd)
    v = linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias")).view(T, nkv, hd)
    if qk_norm == "projection":
        q = rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps)
    q, k = q.view(T, nh, hd), k.view(T, nkv, hd)
    if qk_norm == "head":
        q = rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    out = torch.empty((T, nh, hd), dtype=x.dtype, device=x.device)
    rep, scale = nh // nkv, cfg.softmax_scale
    for s in batch.seqs:
        rows = slice(s.offset, s.offset + s.n)
        runs = s.cache.write(layer, s.start, [k[rows], v[rows]])             # [(k_r, v_r) (S_r, nkv, hd)], sum S_r = S
        ks = [kr.repeat_interleave(rep, dim=1) for kr, _ in runs]
        vs = [vr.repeat_interleave(rep, dim=1) for _, vr in runs]
        scores = _cat_scores([torch.einsum("thd,shd->hts", q[rows], kr) for kr in ks]) * scale   # (nh, n, S)
        mask = _mask(s, x.device, cfg.sliding_window)
        out[rows] = _attend_runs(_softmax_attend(scores, mask), vs, lambda p, vr: torch.einsum("hts,shd->thd", p, vr))
    return linear(out.reshape(T, nh * hd), w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))


def mla_cache_widths(cfg: ModelConfig, indexed: bool = False) -> list[tuple[int, ...]]:
    """The compressed latent (and, with the indexer, its keys) per position."""
    return [(cfg.kv_lora_rank + cfg.qk_rope_head_dim,)] + ([lightning.cache_width(cfg)] if indexed else [])


def _absorbed(w: dict, p: str, nh: int, dn: int, dv: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj (nh*(dn+dv), R) split per head into W_uk (nh, dn, R) and W_uv^T (nh, R, dv), contiguous for bmm;
    derived once per layer and kept next to the weights."""
    key = p + "kv_b_proj.absorbed"
    if key not in w:
        wkv_b = dense_weight(w[p + "kv_b_proj.weight"]).view(nh, dn + dv, R)
        w[key] = (wkv_b[:, :dn].contiguous(), wkv_b[:, dn:].transpose(1, 2).contiguous())
    return w[key]


def mla_attention(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int, rope: Rope,
                  cos: torch.Tensor, sin: torch.Tensor, indexed: bool = False) -> torch.Tensor:
    """Multi-head latent attention. The cache holds c_kv = norm(W_dkv x) (R) and the roped shared key (r) per
    position; kv_b_proj is absorbed: q_nope is mapped into latent space and the latent output is mapped to values,
    so keys/values are never expanded per head. indexed (DeepSeek-V3.2): the lightning indexer's keys are cached
    too and each query attends only to the keys it selects.  x: (T, H) -> (T, H)."""
    T, nh = x.shape[0], cfg.num_heads
    dn, dr, dv, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    idx = None
    if cfg.q_lora_rank is None:
        q = linear(x, w[p + "q_proj.weight"])
    else:
        qa = linear(x, w[p + "q_a_proj.weight"], w.get(p + "q_a_proj.bias"))
        q_resid = rms_norm(qa, w[p + "q_a_layernorm.weight"], LORA_NORM_EPS)                 # (T, q_lora_rank)
        q = linear(q_resid, w[p + "q_b_proj.weight"])
        if indexed:
            idx = lightning.project(cfg, w, p, x, q_resid, rope, cos, sin)
    q = q.view(T, nh, dn + dr)
    q_nope, q_rot = q[..., :dn], rope.apply(q[..., dn:], cos, sin)
    ckv = linear(x, w[p + "kv_a_proj_with_mqa.weight"], w.get(p + "kv_a_proj_with_mqa.bias"))   # (T, R + dr)
    c = rms_norm(ckv[:, :R], w[p + "kv_a_layernorm.weight"], LORA_NORM_EPS)
    k_rot = rope.apply(ckv[:, None, R:], cos, sin)[:, 0]                                       # (T, dr)
    w_uk, w_uv_t = _absorbed(w, p, nh, dn, dv, R)
    q_lat = torch.matmul(q_nope.transpose(0, 1), w_uk)                                        # (nh, T, R)
    q_rot = q_rot.transpose(0, 1)                                                             # (nh, T, dr)
    out_lat = torch.empty((nh, T, R), dtype=x.dtype, device=x.device)
    scale = cfg.softmax_scale
    latent = torch.cat([c, k_rot], dim=-1)                                                    # (T, R + dr)
    for s in batch.seqs:
        rows = slice(s.offset, s.offset + s.n)
        runs = s.cache.write(layer, s.start, [latent[rows]] + ([idx.k[rows]] if idx is not None else []))
        lats = [r[0] for r in runs]                                                           # [(S_r, R + dr)]
        scores = _cat_scores([torch.matmul(q_lat[:, rows], lat[:, :R].t()) + torch.matmul(q_rot[:, rows], lat[:, R:].t())
                              for lat in lats]) * scale                                       # (nh, n, S)
        mask = _mask(s, x.device, None)
        if idx is not None:                    # the indexer's top-k over every cached key: (S, d_index) in one piece
            keys = runs[0][1] if len(runs) == 1 else torch.cat([r[1] for r in runs])
            mask = lightning.select(cfg, idx.q[rows], keys, idx.weights[rows], mask)
        out_lat[:, rows] = _attend_runs(_softmax_attend(scores, mask), [lat[:, :R] for lat in lats], torch.matmul)
    o = torch.matmul(out_lat, w_uv_t).transpose(0, 1)                                         # (T, nh, dv)
    return linear(o.reshape(T, nh * dv), w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))
