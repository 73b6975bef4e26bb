"""DeepSeek-V4's release format: FP8 128x128 blocks and FP4 routed experts, each Linear's scale under `X.scale`.

quantization_config quant_method "fp8", fmt e4m3, scale_fmt "ue8m0", weight_block_size [128, 128], and
`expert_dtype` "fp4" (top level in V4's config.json, inside quantization_config from V4.1 on):
  FP8 Linear    X.weight (N, K) F8_E4M3 + X.scale (ceil(N/128), ceil(K/128)) E8M0 (F8_E8M0 or U8 bytes; F32 read too)
                W = e4m3(weight) * 2^(scale - 127), in float32
  FP4 expert    X.weight (N, K/2) I8 / U8: two E2M1 codes a byte, the lower input index in the low nibble
                + X.scale (N, K/32) E8M0: W = e2m1 * 2^(scale - 127) per block of 32 inputs
Tensors without a `.scale` (norms, the compressors' BF16 projections, the router) are read as stored.
An FP4 expert is an integer grid (2 x E2M1 is an integer in -12..12; its scale halved, a power of two), the same
grid as gpt-oss's MXFP4 (ktconvert.sources.fused_experts), which int8 layouts with group 32 hold exactly.
FP8 values times power-of-two scales are exact in bf16 (3 mantissa bits in 7).
"""
from __future__ import annotations

import numpy as np

from ktconvert.sources.fp8 import dequant_fp8_block
from ktconvert.sources.quantized.grid import IntGrid, contiguous_g_idx
from ktconvert.sources.quantized.scheme import QuantScheme, QuantTensorInfo, WeightFormat, scale_values
from ktconvert.sources.quantized.values import E8M0_NAN, e8m0_exponents, pow2, unpack_e2m1_times_two
from ktconvert.sources.roles import SourceError

FP8_BLOCKS = WeightFormat("deepseek-v4", "fp8", 8, -2)
FP4 = WeightFormat("deepseek-v4", "mxfp4", 4, 32)
E8M0_DTYPES = ("F8_E8M0", "U8")


class DeepseekV4Scheme(QuantScheme):
    family = "deepseek-v4"
    parts = ("weight", "scale")
    markers = ("scale",)

    def __init__(self, qc: dict, where: str):
        super().__init__(qc, where)
        block = qc.get("weight_block_size") or [128, 128]
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise SourceError(f"{self.field('weight_block_size')} = {block!r} is not two positive integers")
        self.block = tuple(block)
        dtype = qc.get("expert_dtype", "fp8")
        if dtype not in ("fp8", "fp4"):
            raise SourceError(f"{self.field('expert_dtype')} = {dtype!r} is not 'fp8' or 'fp4'")

    def describe(self, module: str, parts: dict, read) -> QuantTensorInfo:
        w = self.need(parts, module, "weight", "a .scale belongs beside its weight")
        s = parts["scale"]
        if len(w.shape) != 2:
            raise SourceError(f"{w.file}: tensor {w.name}: quantized weight must be 2-D, got shape {list(w.shape)}")
        n, k = w.shape
        if w.dtype == "F8_E4M3":
            bn, bk = self.block
            self.check(s, (*E8M0_DTYPES, "F32"), (-(-n // bn), -(-k // bk)), f"one scale per {bn}x{bk} block")
            return self.make_info(module, parts, (n, k), FP8_BLOCKS)
        self.check(w, ("I8", "U8"), None, "FP4 weight: two E2M1 codes a byte")
        k = 2 * k
        if k % 32:
            raise SourceError(f"{w.file}: tensor {w.name}: FP4 rows of K={k} are not whole blocks of 32")
        self.check(s, E8M0_DTYPES, (n, k // 32), "FP4: one E8M0 scale per 32 inputs")
        return self.make_info(module, parts, (n, k), FP4)

    def _exponents(self, info, part) -> np.ndarray:
        e = np.asarray(part, dtype=np.uint8)
        if (e == E8M0_NAN).any():
            where = tuple(int(x) for x in np.argwhere(e == E8M0_NAN)[0])
            raise SourceError(f"{info.file}: tensor {info.name}: E8M0 NaN scale (255) at {where}")
        return e8m0_exponents(e)

    def decode(self, info: QuantTensorInfo, read):
        p = info.parts
        k = info.shape[1]
        if info.fmt is FP8_BLOCKS:
            s = p["scale"]
            raw = read(s)
            scales = (scale_values(raw, s, "scale") if s.dtype == "F32" else pow2(self._exponents(s, raw)))
            return dequant_fp8_block(np.asarray(read(p["weight"])).view(np.uint8), scales, self.block)
        e = self._exponents(p["scale"], read(p["scale"]))                   # (N, K/32)
        q = unpack_e2m1_times_two(np.asarray(read(p["weight"])).view(np.uint8), k)    # (N, K) = 2 x E2M1
        return IntGrid(q, pow2(e - 1), contiguous_g_idx(k, 32), FP4.label)
