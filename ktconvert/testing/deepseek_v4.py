"""DeepSeek-V4's release quantization, as the fixture factory writes it (the reader is
ktconvert.sources.quantized.deepseek_v4; tests/test_deepseek_v4.py checks both against transformers' own dequantizer).

config.json: quantization_config {quant_method fp8, fmt e4m3, scale_fmt ue8m0, activation_scheme dynamic,
weight_block_size [128, 128]} and top-level expert_dtype "fp4". Tensors:
- routed experts `layers.N.ffn.experts.E.w{1,2,3}.weight`: FP4, (N, K/2) I8, two E2M1 codes a byte (lower input index
  in the low nibble), + `.scale` (N, K/32) F8_E8M0 (ktconvert.testing.mxfp4's encoder: block max in [4, 8));
- attention projections (wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b) and the shared expert: FP8 e4m3 128x128
  blocks with power-of-two scales, `.scale` F8_E8M0 (ue8m0);
- everything else as the unquantized fixture stores it (the compressors' and indexer's wkv / wgate / weights_proj
  stay BF16, as the release ships them).
"""
from __future__ import annotations

import re

import numpy as np
import torch

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}
FP4_NAME = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
FP8_NAME = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])"
                      r"\.weight$")


def _e8m0(exponents: np.ndarray) -> torch.Tensor:
    """Unbiased power-of-two exponents -> torch.float8_e8m0fnu (bytes e + 127)."""
    return torch.from_numpy(np.ascontiguousarray(exponents + 127, dtype=np.uint8)).view(torch.float8_e8m0fnu)


def fp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    from ktconvert.testing.mxfp4 import quantize_mxfp4

    n, k = w.shape
    blocks, scales = quantize_mxfp4(w.float().numpy())        # (N, K/32, 16), (N, K/32) biased exponents
    weight = torch.from_numpy(np.ascontiguousarray(blocks.reshape(n, k // 2))).view(torch.int8)
    return {"weight": weight, "scale": _e8m0(scales.astype(np.int32) - 127)}


def fp8(w: torch.Tensor, block=(128, 128)) -> dict[str, torch.Tensor]:
    from ktconvert.sources.fp8 import quantize_fp8_block

    bits, scale_inv = quantize_fp8_block(w.float().numpy(), tuple(block), pow2_scales=True)
    return {"weight": torch.from_numpy(bits).view(torch.float8_e4m3fn),
            "scale": _e8m0(np.log2(scale_inv).astype(np.int32))}


def release_tensors(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """One hub tensor as the quantized release stores it (None: stored as in the unquantized fixture)."""
    kind = fp4 if FP4_NAME.match(name) else fp8 if FP8_NAME.match(name) else None
    if kind is None:
        return None
    base = name.removesuffix(".weight")
    return {f"{base}.{part}": v for part, v in kind(t).items()}


def release_config(hub_cfg: dict) -> dict:
    return {**hub_cfg, "quantization_config": dict(QUANTIZATION_CONFIG), "expert_dtype": "fp4"}
