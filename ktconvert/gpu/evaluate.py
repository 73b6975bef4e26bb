"""What GPTQ buys on a checkpoint: KL of the INT4-GPU-layer model's next-token distribution to the float model's,
GPTQ against RTN, on the calibration tokens and on other (held-out) tokens. Used by bench/bench_gptq.py and the
calibration tests.

Both methods run through the same layer-by-layer driver (ktconvert.gpu.calib.LayerwiseGptq) that conversion uses;
on held-out tokens the weights quantized on the calibration pass are replayed unchanged.
"""
from __future__ import annotations

import torch

from ktconvert.gpu.calib import LayerwiseGptq
from ktconvert.gpu.encoder import GpuLayerEncoder, GpuLayerOptions
from ktconvert.gpu.rtn import quantize_rtn

GPU_KINDS = ("attention", "shared_expert", "dense_mlp")


class _Fixed:
    """A QuantizedLinear stand-in whose dequantized weight is already known (replaying weights on other tokens)."""

    def __init__(self, w):
        self.w = w

    def dequantize(self):
        return self.w


def last_hidden_states(src, calib: torch.Tensor, held: torch.Tensor,
                       group_size: int = 128) -> dict[str, dict[str, torch.Tensor]]:
    """{"float"|"gptq"|"rtn": {"calib"|"heldout": (B, T, H) hidden states after the last layer}}.

    calib, held: (B, T) token ids. GPU layers (attention, shared experts, dense MLPs) INT4 with `group_size`;
    quantized on the calibration pass, then replayed unchanged on the held-out tokens."""
    def target(name):
        return src.arch.classify(name).kind in GPU_KINDS

    def run(tokens, qf):
        cal = LayerwiseGptq(src, tokens, qf, target)
        for li in range(src.arch.num_layers):
            cal._run_layer(li)
        return cal.hidden

    enc = GpuLayerEncoder(GpuLayerOptions(method="gptq-int4", group_size=group_size), src=src)

    def rtn(name, w, h):
        return quantize_rtn(enc._pad(name, w)[0], 4, group_size)

    out = {"float": {"calib": run(calib, lambda *a: None), "heldout": run(held, lambda *a: None)}}
    for method, qf in (("gptq", enc.quantize_with_hessian), ("rtn", rtn)):
        weights = {}

        def record(name, w, h, qf=qf, weights=weights):
            q = qf(name, w, h)
            weights[name] = q.dequantize()[: w.shape[0], : w.shape[1]]
            return q
        out[method] = {"calib": run(calib, record),
                       "heldout": run(held, lambda name, w, h, ws=weights: _Fixed(ws[name]))}
    return out


def gptq_vs_rtn_kl(src, calib: torch.Tensor, held: torch.Tensor, group_size: int = 128) -> dict[tuple[str, str], float]:
    """{(method, split): mean KL in nats/token of the next-token distribution to the float model's}."""
    norm_w, head, eps = src.read("model.norm.weight"), src.read("lm_head.weight"), src.config["rms_norm_eps"]

    def log_probs(h):                      # final RMSNorm + lm_head, as the model applies them
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w
        return torch.log_softmax(h @ head.T, -1)

    hidden = last_hidden_states(src, calib, held, group_size)
    ref = {split: log_probs(h) for split, h in hidden["float"].items()}
    return {(m, split): float((ref[split].exp() * (ref[split] - log_probs(hidden[m][split]))).sum(-1).mean())
            for m in ("gptq", "rtn") for split in ("calib", "heldout")}
