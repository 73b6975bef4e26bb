"""DeepSeek-V4's forward (ktlayouts.families.deepseek_v4 describes the model): hyper-connections around each
attention and MoE block (decoder_layer, the hook MoEModel calls instead of its own layer), the attention in
deepseek_v4_attention, sqrt-softplus and hash routing (route), the shared expert's clamped SwiGLU here in torch and
the routed experts on the expert executor.

Hyper-connections: the residual is hc_mult streams x (T, hc, H). Before a block, the streams (flattened, RMS-normed
without weight) are projected by fn ((2 + hc) hc, hc H) into pre (hc), post (hc) and comb (hc x hc) mixes:
pre = sigmoid(. * scale0 + base) + eps collapses the streams into the block's input; post = 2 sigmoid(...) spreads
its output back; comb = softmax rows + eps, then Sinkhorn-Knopp (columns, then rows and columns hc_sinkhorn_iters - 1
times, each sum + eps) mixes the old streams: x'[k] = post[k] * out + sum_j comb[j, k] x[j]. After the last layer
hc_head's pre collapses the streams before the final norm.

The routed experts' clamped SwiGLU silu(min(g, L)) * clamp(u, -L, L) (swiglu_limit L) runs in the expert executors
(ExpertActivation "silu_clamped": the kernels' KT_ACT_SILU_CLAMPED, or the torch reference); the shared expert's here.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from ktlayouts.families import ConfigError, ModelConfig
from ktlayouts.families.deepseek_v4 import settings

from ..ops.packed_linear import linear
from . import deepseek_v4_attention as v4attn
from .choices import top_k
from .layers import Rope

__all__ = ["attention", "cache_widths", "choice_layers", "decoder_layer", "route"]


def _settings(cfg: ModelConfig):
    return settings(cfg)


def cache_widths(cfg: ModelConfig) -> list[tuple[int, ...]]:
    return v4attn.cache_widths(cfg, _settings(cfg))


def attention(cfg, w, p, x, batch, layer, rope, cos, sin):
    raise ConfigError("DeepSeek-V4 attention runs inside decoder_layer (it needs both ropes and the layer type)")


def _scores(cfg, w: dict, p: str, x: torch.Tensor, scoring: str) -> torch.Tensor:
    logits = linear(x, w[p + "gate.weight"].to(x.dtype)).float()          # (T, E)
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)


def route(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, token_ids: torch.Tensor | None = None):
    """p: 'layers.N.ffn.'; x: (T, H) -> ids (T, k), weights (T, k) float32. A hash layer (its gate has tid2eid)
    takes the experts tid2eid[token] (token_ids (T,) needed); otherwise the top-k of scores + gate.bias. Weights:
    the chosen scores normalized to sum 1, times routed_scaling_factor."""
    s = settings(cfg)
    scores = _scores(cfg, w, p, x, s.scoring)
    table = w.get(p + "gate.tid2eid")
    if table is not None:
        if token_ids is None:
            raise ValueError(f"{p}gate: a hash-routed layer needs the token ids")
        ids = table.to(torch.long)[token_ids.to(table.device)]               # (T, k)
    else:
        bias = w.get(p + "gate.bias")
        ids = top_k("router", scores if bias is None else scores + bias.float(), cfg.top_k)
    wts = scores.gather(1, ids)
    wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, wts * cfg.routed_scaling_factor


def _hc_mix(s, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, eps: float):
    """x: (T, hc, H) -> (post (T, hc), comb (T, hc, hc), collapsed (T, H))."""
    hc = s.hc_mult
    flat = v4attn.unweighted_rms_norm(x.reshape(x.shape[0], -1).float(), eps)
    mix = F.linear(flat, fn.float())                                        # (T, (2 + hc) hc)
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + s.hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + s.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + s.hc_eps)
    for _ in range(s.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + s.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + s.hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return post, comb, collapsed


def _hc_out(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """x' = post * out + comb^T x: (T, hc, H)."""
    dt = x.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), x)


def _hc_head(s, w: dict, x: torch.Tensor, eps: float) -> torch.Tensor:
    flat = v4attn.unweighted_rms_norm(x.reshape(x.shape[0], -1).float(), eps)
    pre = torch.sigmoid(F.linear(flat, w["hc_head_fn"].float()) * w["hc_head_scale"].float()
                        + w["hc_head_base"].float()) + s.hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def _shared_expert(s, w: dict, p: str, h: torch.Tensor) -> torch.Tensor:
    g = linear(h, w[p + "w1.weight"]).clamp(max=s.swiglu_limit)
    u = linear(h, w[p + "w3.weight"]).clamp(min=-s.swiglu_limit, max=s.swiglu_limit)
    return linear(F.silu(g) * u, w[p + "w2.weight"])


def _state(model):
    st = getattr(model, "_deepseek_v4", None)
    if st is None:
        s = _settings(model.cfg)
        st = model._deepseek_v4 = {"s": s, "ropes": {"main": model.rope,
                                                     "compress": Rope(s.compress_rope, model.device)}}
    return st


def decoder_layer(model, i: int, x: torch.Tensor, h, batch, cos, sin):
    """Layer i: x (T, H) embeddings at layer 0, else (T, hc, H) streams -> (streams, None), or after the last
    layer (streams, the final-normed collapse (T, H))."""
    cfg, w = model.cfg, model.w
    st = _state(model)
    s, eps = st["s"], cfg.rms_norm_eps
    if i == 0:
        x = x.unsqueeze(1).expand(-1, s.hc_mult, -1).contiguous()
    p = model.names.layer(i)
    clock, tm = time.perf_counter, model.timing
    t1 = clock()
    post, comb, collapsed = _hc_mix(s, w[p + "hc_attn_fn"], w[p + "hc_attn_base"], w[p + "hc_attn_scale"], x, eps)
    a = v4attn.attention(cfg, s, w, p + "attn.", v4attn.rms_norm(collapsed, w[p + "attn_norm.weight"], eps), batch,
                         i, cfg.layer_types[i], st["ropes"], batch.positions.to(x.device))
    x = _hc_out(x, a, post, comb)
    t2 = clock()
    post, comb, collapsed = _hc_mix(s, w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"], w[p + "hc_ffn_scale"], x, eps)
    hn = v4attn.rms_norm(collapsed, w[p + "ffn_norm.weight"], eps)
    fp = p + "ffn."
    ids, wts = route(cfg, w, fp, hn, batch.tokens)
    out = torch.empty_like(hn)
    model.experts.submit(i, hn, ids, wts, out)                 # the routed experts run while the shared one does
    shared = _shared_expert(s, w, fp + "shared_experts.", hn)
    t0 = clock()
    model.experts.sync()
    tm["expert_wait_s"] += clock() - t0
    x = _hc_out(x, out + shared, post, comb)
    tm["attention_s"] += t2 - t1
    tm["mlp_s"] += clock() - t2
    if i + 1 < cfg.num_layers:
        return x, None
    return x, v4attn.rms_norm(_hc_head(s, w, x, eps), w[model.names.final_norm], eps)


INDEXER_OVER_ENTRIES = True    # the indexer's top-k rows are queries, its columns compressed entries


def choice_layers(cfg: ModelConfig) -> dict[str, list[int]]:
    """The layers whose forward makes each kind of top-k choice (tests/discrete_choices.py): the router in the
    top-k MoE layers (hash layers take tid2eid's experts), the indexer in the CSA layers."""
    s = settings(cfg)
    return {"router": [i for i, t in enumerate(s.mlp_layer_types) if t == "moe"],
            "indexer": [i for i, t in enumerate(cfg.layer_types) if t == "compressed_sparse_attention"]}
