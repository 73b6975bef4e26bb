"""Routers: token -> (expert ids (T, k) int64, weights (T, k) float32), in float32 as the reference computes them.

- sigmoid_grouped (DeepSeek-V3 / V3.2, GLM-4.5 "noaux_tc"; MiniMax-M2 with one group): sigmoid scores; choice adds
  e_score_correction_bias (zeros when the checkpoint has none); keep the topk_group groups with the best sum of
  their top-2 choice scores; top-k inside them; weights are the *unbiased* scores, normalized when norm_topk_prob,
  times routed_scaling_factor. Decode rows of a float32 CPU model take the same steps in one C call
  (ktrun.ops.glue.route_sigmoid: its own fixed summation order), unless a test's choice hook is installed.
- softmax_topk (DeepSeek-V2 greedy / group_limited_greedy, Qwen3-MoE, Mixtral): the logits' precision and whether
  norm_topk_prob renormalizes come from the config (router_float32, router_renormalizes), not from the family.
  Decode rows of a float32 CPU model take the same steps in one C call (ktrun.ops.glue.route_softmax), as above
  (a float32 model's logits are float32 either way).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ktlayouts.families import ModelConfig

from ..ops import glue
from .choices import hooked, top_k


def _group_mask(choice: torch.Tensor, group_scores: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """choice: (T, E), group_scores: (T, n_group) -> bool (T, E): experts inside the topk_group best groups."""
    T, E = choice.shape
    gidx = top_k("router_group", group_scores, cfg.topk_group)
    gmask = torch.zeros_like(group_scores).scatter_(1, gidx, 1.0)
    return gmask[:, :, None].expand(T, cfg.n_group, E // cfg.n_group).reshape(T, E).bool()


def sigmoid_grouped(cfg: ModelConfig, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None):
    if not hooked() and glue.route_sigmoid_supported(x, gate_w, bias):   # decode rows on the CPU: one C call
        return glue.route_sigmoid(x, gate_w, bias, cfg.n_group, cfg.topk_group, cfg.top_k, cfg.norm_topk_prob,
                                      cfg.routed_scaling_factor)
    T, E = x.shape[0], cfg.num_experts
    scores = F.linear(x.float(), gate_w.float()).sigmoid()                    # (T, E)
    choice = scores if bias is None else scores + bias.float()
    if cfg.topk_group < cfg.n_group:      # else every group is kept (one group: MiniMax-M2, small V3 configs)
        gs = choice.view(T, cfg.n_group, E // cfg.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(choice, gs, cfg), float("-inf"))
    ids = top_k("router", choice, cfg.top_k)
    wts = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, wts * cfg.routed_scaling_factor


def softmax_topk(cfg: ModelConfig, x: torch.Tensor, gate_w: torch.Tensor):
    grouped = cfg.topk_method == "group_limited_greedy"
    if not hooked() and glue.route_sigmoid_supported(x, gate_w, None):   # decode rows on the CPU: one C call
        return glue.route_softmax(x, gate_w, cfg.n_group if grouped else 1, cfg.topk_group if grouped else 1,
                                  cfg.top_k, cfg.norm_topk_prob and cfg.router_renormalizes, cfg.routed_scaling_factor)
    T, E = x.shape[0], cfg.num_experts
    logits = F.linear(x.float(), gate_w.float()) if cfg.router_float32 else F.linear(x, gate_w.to(x.dtype))
    scores = F.softmax(logits, dim=-1, dtype=torch.float32)                   # (T, E)
    if cfg.topk_method == "group_limited_greedy":
        gs = scores.view(T, cfg.n_group, E // cfg.n_group).max(dim=-1).values
        scores = scores.masked_fill(~_group_mask(scores, gs, cfg), 0.0)
    ids = top_k("router", scores, cfg.top_k, sorted=not cfg.router_float32)  # (V2's reference: unsorted)
    wts = scores.gather(1, ids)
    if cfg.norm_topk_prob and cfg.router_renormalizes:
        wts = wts / wts.sum(dim=-1, keepdim=True)
    return ids, wts * cfg.routed_scaling_factor
