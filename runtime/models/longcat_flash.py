"""LongCat-Flash: per decoder layer two MLA attention sublayers and two dense SwiGLU MLPs, plus one MoE fed by the
first sublayer's normed activations whose output joins the residual only at the end of the layer (the shortcut
MoE; ktlayouts.families.longcat_flash has the layer's equations). MoEModel.forward's one attention + one MLP per
layer cannot say that, so this module defines `decoder_layer`, which MoEModel calls instead when a family's module
has one.

- Attention: attention.mla_attention as is. LongCat scales q by sqrt(hidden / q_lora_rank) and the normalized kv
  latent by sqrt(hidden / kv_lora_rank); both are linear in the RMSNorm weight just before them, so the scales are
  folded into q_a_layernorm / kv_a_layernorm once (the same products up to rounding). Sublayer j of layer i uses
  KV cache slot 2i + j (cache_layers: 2 x num_layers slots).
- Router: float32 softmax over n_routed + zero experts, choice by score + e_score_correction_bias (choices.top_k),
  weights = the unbiased scores x routed_scaling_factor.
- Zero (identity) experts: their picks never reach the expert executor (id -1: skipped by the kernels and the torch
  reference alike, no compute, weight 0); their weights times the MoE input are added here, in torch.
- The routed experts run on the executor while the first dense MLP, which reads the same input, runs here.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from ktlayouts.families import ModelConfig

from .attention import mla_attention, mla_cache_widths, prepare_absorbed
from .choices import top_k
from .layers import SERIAL_MAX_ROWS, serial_torch, swiglu_mlp

__all__ = ["attention", "cache_layers", "cache_widths", "decoder_layer", "route", "split_zero_experts"]

FOLDED = "longcat.lora_scales_folded"      # marker key in the weights dict: the LoRA scales are in the norms


def route(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p: 'model.layers.N.mlp.'; x: (T, H) -> ids (T, k) int64 in [0, num_experts + zero_experts) (ids >=
    num_experts are zero experts: split_zero_experts), weights (T, k) float32."""
    logits = F.linear(x.float(), w[p + "router.classifier.weight"].float(),
                      None if (b := w.get(p + "router.classifier.bias")) is None else b.float())    # (T, E + Z)
    scores = logits.softmax(dim=-1)
    bias = w.get(p + "router.e_score_correction_bias")
    choice = scores if bias is None else scores + bias.float()
    ids = top_k("router", choice, cfg.top_k)
    return ids, scores.gather(1, ids) * cfg.routed_scaling_factor


def split_zero_experts(cfg: ModelConfig, ids: torch.Tensor, wts: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (ids with zero experts as -1, their weights 0, identity weight (T, 1): the sum of the zero picks' weights)."""
    zero = ids >= cfg.num_experts
    identity = wts.masked_fill(~zero, 0.0).sum(dim=-1, keepdim=True)
    return ids.masked_fill(zero, -1), wts.masked_fill(zero, 0.0), identity


def cache_layers(cfg: ModelConfig) -> int:
    """Two MLA attention sublayers per decoder layer, each with its latent cache."""
    return 2 * cfg.num_layers


cache_widths = mla_cache_widths


def attention(cfg, w, p, x, batch, layer, rope, cos, sin):
    """One MLA sublayer (p: 'model.layers.N.self_attn.J.', layer: its cache slot 2N + J). The LoRA scales must be
    folded in (decoder_layer does it before the first forward)."""
    return mla_attention(cfg, w, p, x, batch, layer, rope, cos, sin)


def _fold_lora_scales(model) -> None:
    """Once, before the first forward: scale every q_a_layernorm by sqrt(hidden / q_lora_rank) and kv_a_layernorm by sqrt(hidden / kv_lora_rank)
    (q = q_b(norm_q(.) * w) * s and the latent c = norm_kv(.) * w * s are linear in w. float32 models keep the
    scaled weights in float32 (no extra rounding of the scale)."""
    cfg, w = model.cfg, model.w
    if w.get(FOLDED):
        return
    scales = {"q_a_layernorm.weight": (cfg.hidden_size / cfg.q_lora_rank) ** 0.5,
              "kv_a_layernorm.weight": (cfg.hidden_size / cfg.kv_lora_rank) ** 0.5}
    for i in range(cfg.num_layers):
        for j in (0, 1):
            p = f"{model.names.layer(i)}self_attn.{j}."
            for name, s in scales.items():
                t = w[p + name]
                dt = torch.float32 if model.dtype == torch.float32 else t.dtype
                w[p + name] = (t.float() * s).to(dt).contiguous()
    # MoEModel derives the absorbed kv_b on the kernels' op for "self_attn." only; the sublayers' here, now, before
    # the first forward touches the routed experts' pages (attention.prepare_absorbed)
    prepare_absorbed(cfg, w, [f"{model.names.layer(i)}self_attn.{j}." for i in range(cfg.num_layers) for j in (0, 1)])
    w[FOLDED] = True


def _moe_submit(model, i: int, h: torch.Tensor):
    """Start layer i's routed experts on the executor for h (T, H); -> finish() returning the MoE output (T, H)."""
    cfg = model.cfg
    with serial_torch(h.shape[0] <= SERIAL_MAX_ROWS):       # a (T, H) x (H, E + Z) matmul: no OpenMP wake-up
        ids, wts = route(cfg, model.w, model.moe_prefix[i], h)
        ids, wts, identity = split_zero_experts(cfg, ids, wts)
    out = torch.empty_like(h)
    model.experts.submit(i, h, ids, wts, out)

    def finish() -> torch.Tensor:
        t0 = time.perf_counter()
        model.experts.sync()
        model.timing["expert_wait_s"] += time.perf_counter() - t0
        return out + h * identity.to(h.dtype)           # routed experts, then the identity ones (transformers' order)
    return finish


def decoder_layer(model, i: int, x: torch.Tensor, h: torch.Tensor | None, batch, cos, sin
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """MoEModel's hook for one decoder layer. x: (T, H) residual stream; h: input_layernorm[0](x) as the previous
    layer left it (None for layer 0: normed here) -> (x after the layer, the next layer's input_layernorm[0] of it,
    or after the last layer the final norm)."""
    cfg, w, clock = model.cfg, model.w, time.perf_counter
    p = model.names.layer(i)
    if h is None:
        _fold_lora_scales(model)
        h = model.norm(x, w[p + "input_layernorm.0.weight"], cfg.rms_norm_eps)
    t1 = clock()
    a = attention(cfg, w, p + "self_attn.0.", h, batch, 2 * i, model.rope, cos, sin)
    x, h = model._add_norm(x, a, w[p + "post_attention_layernorm.0.weight"])
    t2 = clock()
    finish = _moe_submit(model, i, h)                   # the shortcut MoE reads the first MLP's input
    m = swiglu_mlp(h, w[p + "mlps.0.gate_proj.weight"], w[p + "mlps.0.up_proj.weight"],
                   w[p + "mlps.0.down_proj.weight"])
    moe = finish()
    x, h = model._add_norm(x, m, w[p + "input_layernorm.1.weight"])
    t3 = clock()
    a = attention(cfg, w, p + "self_attn.1.", h, batch, 2 * i + 1, model.rope, cos, sin)
    x, h = model._add_norm(x, a, w[p + "post_attention_layernorm.1.weight"])
    t4 = clock()
    x = x + swiglu_mlp(h, w[p + "mlps.1.gate_proj.weight"], w[p + "mlps.1.up_proj.weight"],
                       w[p + "mlps.1.down_proj.weight"])
    last = i + 1 == cfg.num_layers
    x, h = model._add_norm(x, moe, w[model.names.final_norm] if last
                           else w[model.names.layer(i + 1) + "input_layernorm.0.weight"])
    t5 = clock()
    model.timing["attention_s"] += (t2 - t1) + (t4 - t3)
    model.timing["mlp_s"] += (t3 - t2) + (t5 - t4)
    return x, h
