"""Which GPU Linears' quantization costs KL: `ktrun perplexity` of one conversion against a `--kl-divergence-base`
file, once as converted and once per --take regex with the matching GPU Linears put back to the weights of a BF16
conversion of the same source (`ktconvert quantize SRC --method bf16 --gpu-method bf16`), everything else as
converted, through the same CPU path. The gap to the first line is what quantizing those Linears costs (an upper
bound on what giving them int8 can buy). docs/quantization.md ("Mixed precision of the GPU layers") has the
measured table of the default model.

    .venv/bin/python bench/bf16_restore_ablation.py CONV BF16_CONV BF16_CONV.logprobs --text heldout.txt \\
        --take . 'layers\\.0\\.mlp\\.down' 'kv_b_proj' 'shared_experts' 'self_attn'
Output lines are `bf16_restore.<tag>.kl_mean: value unit` (and kl_p99) per case.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from ktlayouts.logprobs import read_logprobs
from ktrun.engine import Engine
from linear_swap import score_swapped


def run_case(conv: Path, bf16_w: dict, text: str, reference, ctx: int, chunks: int, take: str | None) -> dict:
    return score_swapped(conv, text, reference, ctx, chunks, take, lambda n, _: bf16_w[n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("conversion", type=Path)
    ap.add_argument("bf16_conversion", type=Path, help="--method bf16 --gpu-method bf16 conversion of the source")
    ap.add_argument("base", type=Path, help="the BF16 conversion's --kl-divergence-base file")
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--take", nargs="*", default=["."], help="regexes of hub weight names to put back to BF16")
    args = ap.parse_args()
    reference = read_logprobs(args.base)
    text = args.text.read_text(encoding="utf-8")
    ref = Engine(args.bf16_conversion, ctx=args.ctx, max_batch=1, gpu_weights="kernels")
    try:
        for take in [None, *args.take]:
            s = run_case(args.conversion, ref.model.w, text, reference, args.ctx, args.chunks, take)
            tag = "none" if take is None else re.sub(r"\W+", "_", take).strip("_") or "all"
            print(f"# {tag}: {s['linears']} Linears back to BF16 ({take!r})")
            print(f"bf16_restore.{tag}.kl_mean: {s['kl_mean']:.6f} nats/token")
            print(f"bf16_restore.{tag}.kl_p99: {s['kl_p99']:.5f} nats/token")
    finally:
        ref.close()


if __name__ == "__main__":
    main()
