"""A MoE layer's decode rows in one library call (kt_moe_decode, ktrun.ops.glue.moe_decode): the residual add and
post-attention norm, the router, the routed experts (with a fused shared expert) and the residual add and next norm,
which MoEModel otherwise runs as five calls with Python between them while the kernel pool waits. Only where each
step is the call it replaces, so the bits are the same: an RMSNorm model, the generic router (ktrun.models.generic:
sigmoid with group-limited top-k, or softmax) on a float32 CPU gate, the routed experts on the kernels (no hot or
tiered executor), no shared-expert gate; decode-sized rows (glue.ROUTE_MAX_ROWS) and no test hook on the router's
choice. A shared expert the routed job does not compute (KernelExperts.fuse_shared refused it: Linears of different
bits or groups, e.g. after the mix's int8 upgrades) runs after the call returns with the job in flight, as
MoEModel._moe runs it."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..ops import glue
from . import generic
from .choices import hooked
from .layers import rms_norm, swiglu_mlp


@dataclass
class MoePlan:
    router: tuple            # glue.moe_decode's router tuple
    layer: int
    shared: int | None       # the fused shared expert's layer id
    kernels: object          # the experts' MoEKernels context
    outside: tuple | None    # an unfused shared expert's (gate, up, down): swiglu_mlp after the routed job
    # the layer's argument block for the norm weights it was made with (glue.MoeDecodeCall, made at the first call:
    # the next norm is the next layer's or the final one); None until then or with a shared expert outside the job
    call: glue.MoeDecodeCall | None = None


def plan(model, i: int) -> MoePlan | None:
    """Layer i's MoePlan, or None when its steps are not all kt_moe_decode's (the module docstring); kept on the
    model (model.moe_plans) for the executor it was made for (a bench or test may swap model.experts)."""
    if model.moe_plans.get("experts") is not model.experts:
        model.moe_plans.clear()
        model.moe_plans["experts"] = model.experts
    if i in model.moe_plans:
        return model.moe_plans[i]
    model.moe_plans[i] = None
    cfg, w = model.cfg, model.w
    if i in model.dense_fused:      # a dense layer's MLP as a one-expert layer (KernelExperts.fuse_dense)
        got = model.experts.one_call_dense(i)
        if got is None or model.norm is not rms_norm:
            return None
        model.moe_plans[i] = MoePlan(("dense", None, None, 1, 1, 1, False, 1.0), got[1], None, got[0], None)
        return model.moe_plans[i]
    one_call = getattr(model.experts, "one_call_layer", None)
    if (one_call is None or model.norm is not rms_norm or i not in model.moe_layers
            or model.arch.route is not generic.route or getattr(model.arch, "shared_expert_scale", None) is not None):
        return None
    got = one_call(i, i in model.shared_fused)
    outside = None                  # a shared expert the routed job does not compute: its Linears, run after it
    if model.names.shared_prefix and cfg.n_shared_experts and i not in model.shared_fused:
        sp = model.names.layer(i) + model.names.shared_prefix
        outside = tuple(w.get(sp + n + ".weight") for n in ("gate_proj", "up_proj", "down_proj"))
        if any(li is None for li in outside):
            return None
    p = model.moe_prefix[i]
    gate = w.get(p + "gate.weight")
    if got is None or not isinstance(gate, torch.Tensor) or gate.dtype not in glue.WEIGHT_DTYPES or not gate.is_cpu or \
            gate.dim() != 2 or not gate.is_contiguous() or gate.shape[1] % 16:
        return None
    if cfg.scoring == "sigmoid":
        bias = next((w[p + b] for b in generic.CORRECTION_BIAS if p + b in w), None)
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                 or bias.numel() != gate.shape[0]):
            return None
        router = ("sigmoid", gate, bias, cfg.n_group, cfg.topk_group, cfg.top_k, cfg.norm_topk_prob,
                  cfg.routed_scaling_factor)
    else:
        grouped = cfg.topk_method == "group_limited_greedy"
        router = ("softmax", gate, None, cfg.n_group if grouped else 1, cfg.topk_group if grouped else 1, cfg.top_k,
                  cfg.norm_topk_prob and cfg.router_renormalizes, cfg.routed_scaling_factor)
    model.moe_plans[i] = MoePlan(router, i, got[1], got[0], outside)
    return model.moe_plans[i]


def run(model, i: int, x: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor, next_w: torch.Tensor,
        batch=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x + delta through layer i's MoE block to the next norm: -> (the residual stream, its norm next_w), or None
    (nothing done) when the layer or these rows are not the call's (plan, decode-sized float32 CPU rows). batch: the
    forward's Batch, told the call taken (Batch.record_one_call)."""
    pl = plan(model, i)
    T = x.shape[0]
    if pl is None or not 0 < T <= glue.ROUTE_MAX_ROWS or hooked() or x.dtype != torch.float32 or \
            delta.dtype != torch.float32 or not x.is_cpu or not delta.is_cpu or x.dim() != 2 or \
            delta.shape != x.shape or x.stride(-1) != 1 or delta.stride(-1) != 1:
        return None
    call = pl.call
    if call is None or call.norm is not norm_w or call.next_norm is not next_w:   # the norms checked once per call
        if not glue.norm_weights_ok(norm_w, next_w) or norm_w.numel() != x.shape[1] or next_w.numel() != x.shape[1]:
            return None
        if pl.outside is None:
            call = pl.call = glue.MoeDecodeCall(norm_w, next_w, model.cfg.rms_norm_eps, pl.router, pl.layer,
                                                pl.shared, pl.kernels, glue.ROUTE_MAX_ROWS)
    if pl.outside is None:
        if batch is not None:
            batch.record_one_call("moe", i, call)
        x_out, h_out, wait = call(x, delta)
    else:   # the shared expert outside the job: its Linears' first submit waits for the routed job (MoEModel._moe)
        t0 = time.perf_counter()
        s, h, _, _, e = glue.moe_decode(x, delta, norm_w, next_w, model.cfg.rms_norm_eps, pl.router, pl.layer, None,
                                        pl.kernels, finish=False)
        shared = swiglu_mlp(h, *pl.outside)
        pl.kernels.sync()
        wait = time.perf_counter() - t0
        x_out, h_out = model._add_norm(s, e + shared, next_w)
    if i in model.moe_layers:       # a dense layer's MLP is not counted among the experts' calls
        model.experts.record_one_call(T * model.cfg.top_k, wait)
    model.timing["expert_wait_s"] += wait
    return x_out, h_out
