"""gpt-oss: GQA with q/k/v/o biases and a sink logit per head; "sliding_attention" layers see the last
sliding_window keys, "full_attention" layers all of them (every position stays in the KV cache, so prefix reuse
works as for any GQA model). Router: a biased Linear, top-k of its logits, softmax over those k. The routed experts'
biases and clamped SwiGLU run in the expert executor (ExpertActivation: the kernels' kt_set_layer_activation, or
the torch reference); no shared experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.packed_linear import linear
from .attention import gqa_attention, gqa_cache_widths
from .choices import top_k


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's order: normalize in float32, scale by the weight in float32, then cast."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def route(cfg, w: dict, p: str, x: torch.Tensor):
    """x: (T, H) -> ids (T, k), weights (T, k) float32: softmax over the k largest router logits (in x's dtype, as
    the reference computes them)."""
    logits = linear(x, w[p + "router.weight"].to(x.dtype), w[p + "router.bias"].to(x.dtype))     # (T, E)
    ids = top_k("router", logits, cfg.top_k, sorted=True)
    top = logits.gather(1, ids)
    return ids, F.softmax(top, dim=-1, dtype=top.dtype).float()


def attention(cfg, w, p, x, batch, layer, rope, cos, sin):
    window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else None
    return gqa_attention(cfg, w, p, x, batch, layer, rope, cos, sin, qk_norm=None, window=window,
                         sinks=w[p + "sinks"])


cache_widths = gqa_cache_widths
