"""The routed experts' activation and biases as the executors compute them (ktlayouts.families.ExpertActivation):
silu(g) * u for most families; DeepSeek-V4's with g and u clamped (silu_clamped); gpt-oss's clamped SwiGLU with per-expert gate/up/down biases, whose values come from
the converted model's dense tensors (the hub's fused bias tensors, kept whole by the converter)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from ktlayouts.families import ExpertActivation, get_family

# layer -> (gate (E, I), up (E, I), down (E, H)) float32 expert biases
Biases = dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]


def expert_biases(converted) -> Biases:
    """The routed experts' biases of a converted model whose family has them (gpt-oss: the fused gate_up / down
    bias tensors kept among the dense tensors), split into gate and up; {} for every other family."""
    cfg = converted.config
    if not cfg.expert_activation.bias:
        return {}
    names = get_family(cfg.model_type).names
    fused = names.fused_experts
    out = {}
    for layer in cfg.moe_layers:
        gu_name, d_name = fused.bias_names(names.layer(layer))
        missing = [n for n in (gu_name, d_name) if n not in converted.dense]
        if missing:
            raise ValueError(f"{converted.root}: no dense file holds the expert bias {missing[0]} of MoE layer "
                             f"{layer}")
        gu = converted.dense[gu_name].detach().float().cpu().numpy()
        g, u = fused.split_gate_up(gu)
        out[layer] = (np.ascontiguousarray(g), np.ascontiguousarray(u),
                      np.ascontiguousarray(converted.dense[d_name].detach().float().cpu().numpy()))
    return out


def activate(act: ExpertActivation, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """h from gate/up outputs (biases already added): ExpertActivation's formula, in the inputs' dtype."""
    if act.kind == "silu":
        return F.silu(g) * u
    g = g.clamp(max=act.limit)
    u = u.clamp(min=-act.limit, max=act.limit)
    if act.kind == "silu_clamped":                                    # DeepSeek-V4
        return F.silu(g) * u
    return (u + 1) * (g * torch.sigmoid(g * act.alpha))
