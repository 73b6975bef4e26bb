"""Which GPU Linears' int8 activations cost KL on the CPU path: `ktrun perplexity` of one conversion against a
`--kl-divergence-base` file, once as loaded (every GPU-quantized Linear on the kernels' int8 Linear op, the CPU
default) and once per --take regex with the matching Linears run in float32 on their dequantized weights instead
(the same codes and scales; only the activation quantization is gone), or with --act-group G on activations
quantized as the op does (symmetric int8, amax / 127, round half to even) per G channels and dequantized: a float
simulation of other activation groups than the weights' (G = the weight group reproduces the op within the float
summation order). A fused shared expert taken off the op also leaves the routed job. bench/README.md ("int8
against Q8_0 on the CPU path") has the measured tables.

    .venv/bin/python bench/int8_op_ablation.py CONV BASE.logprobs --text heldout.txt \\
        --take . 'layers\\.0\\.mlp\\.' 'layers\\.0\\.mlp\\.down' 'self_attn'
    .venv/bin/python bench/int8_op_ablation.py CONV BASE.logprobs --text heldout.txt --take . --act-group 16
Output lines are `name: value unit` (kl_mean, kl_p99 per case).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from ktlayouts.logprobs import read_logprobs
from ktrun.ops.kernel_linear import KernelLinear
from linear_swap import score_swapped


class SimulatedOp:
    """y = dequant(quant_G(x)) W^T in float32: W the Linear's dequantized weights, x quantized per G channels."""

    def __init__(self, kl: KernelLinear, group: int):
        self.w, self.k, self.g = kl.dequantize(torch.float32), kl.k, group

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.k).float()                                   # (T, K)
        kp = -(-self.k // self.g) * self.g
        xg = F.pad(x2, (0, kp - self.k)).view(x2.shape[0], -1, self.g)       # (T, K/G, G)
        s = xg.abs().amax(-1, keepdim=True) / 127
        q = torch.round(xg / torch.where(s > 0, s, 1)).clamp(-127, 127)
        y = ((q * s).view(x2.shape[0], kp)[:, : self.k] @ self.w.T).reshape(*x.shape[:-1], -1).to(x.dtype)
        return y if b is None else y + b


def run_case(conv: Path, text: str, reference, ctx: int, chunks: int, take: str | None, act_group: int) -> dict:
    return score_swapped(conv, text, reference, ctx, chunks, take,
                         lambda _, li: SimulatedOp(li, act_group) if act_group else li.dequantize(torch.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("conversion", type=Path)
    ap.add_argument("base", type=Path, help="the BF16 conversion's --kl-divergence-base file")
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--take", nargs="*", default=["."], help="regexes of hub weight names to take off the op")
    ap.add_argument("--act-group", type=int, default=0,
                    help="0: float activations; G: int8 activations per G channels, simulated in float32")
    args = ap.parse_args()
    reference = read_logprobs(args.base)
    text = args.text.read_text(encoding="utf-8")
    for take in [None, *args.take]:
        s = run_case(args.conversion, text, reference, args.ctx, args.chunks, take, args.act_group)
        tag = "none" if take is None else re.sub(r"\W+", "_", take).strip("_") or "all"
        if take is not None and args.act_group:
            tag += f"_act_g{args.act_group}"
        print(f"# {tag}: {s['linears']} Linears off the op ({take!r})")
        print(f"int8_op_ablation.{tag}.kl_mean: {s['kl_mean']:.6f} nats/token")
        print(f"int8_op_ablation.{tag}.kl_p99: {s['kl_p99']:.5f} nats/token")


if __name__ == "__main__":
    main()
