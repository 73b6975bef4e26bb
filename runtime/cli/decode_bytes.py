"""Bytes of weights one decoded token reads (`ktrun bench`): the roofline of a decode step.

Per token (T = 1) a decode step reads
  experts  top_k routed experts of every MoE layer (gate, up, down tiles + scales, all shards), as the CPU
           kernels read them in place (experts resident on a GPU excluded when the executor says which: not counted
           here, so with hot experts this is an upper bound);
  dense    every other weight the forward reads once per token: attention (MLA's absorbed kv_b pair where it was
           derived, not the kv_b tiles it came from), shared experts, dense MLPs, routers, norms; one embedding row;
  head     lm_head (or the tied embedding).
Sizes are those of the weights as the runtime holds them (repacked int4/int8 tiles, Marlin words, float tensors), so
a dense part dequantized to float32 counts 4 bytes per weight.
"""
from __future__ import annotations

import torch


def _nbytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    return int(getattr(v, "nbytes", 0))


def expert_bytes(converted) -> int:
    """Bytes of one routed expert (every projection, every shard), from the mapped tiles."""
    per_layer = []
    for shards in converted.experts.values():
        n_experts = converted.geometry.n_experts
        per_layer.append(sum(qw.nbytes + (0 if sc is None else sc.nbytes)
                             for shard in shards for qw, sc, _g in shard.values()) // n_experts)
    return max(per_layer, default=0)


def weight_bytes_per_token(model, converted) -> dict[str, int]:
    """-> {'experts', 'dense', 'head', 'total'} bytes read per decoded token (call after a forward: the absorbed
    kv_b pairs are derived on first use)."""
    cfg, w = model.cfg, model.w
    experts = len(cfg.moe_layers) * cfg.top_k * expert_bytes(converted)
    head = _nbytes(model.lm_head)
    dense = 0
    names = model.names          # the family's hub names (Kimi-K2.5's language_model., Qwen3.5's language_model)
    for name, v in w.items():
        if name == names.head:
            continue
        if name == names.embed:
            dense += _nbytes(v) // max(1, v.shape[0])                 # one row per token
        elif name.endswith("kv_b_proj.weight") and name.removesuffix("weight") + "absorbed" in w:
            continue                                                  # read through its absorbed pair
        else:
            dense += _nbytes(v)
    return {"experts": experts, "dense": dense, "head": head, "total": experts + dense + head}


def read_bandwidth(experts) -> float:
    """The machine's read bandwidth (bytes/s), measured now with the kernels' pool (a temporary one when the
    executor has none); 0 when libktkernels is not available."""
    moe = getattr(experts, "moe", None) or getattr(getattr(experts, "cpu", None), "moe", None)
    if moe is not None:
        return moe.measure_read_bandwidth()
    from ..ops.library import kernels_available
    if not kernels_available():
        return 0.0
    from ..ops.moe import MoEKernels
    with MoEKernels() as k:
        return k.measure_read_bandwidth()
