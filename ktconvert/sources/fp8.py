"""DeepSeek-style FP8 block dequantization on the CPU (numpy only, no GPU).

DeepSeek-V3 ships Linear weights as float8_e4m3fn with one f32 `weight_scale_inv` per 128x128 block:
    W[n, k] = fp8(bits[n, k]) * scale_inv[n // 128, k // 128]
computed in f32. Shapes that are not block multiples have partial blocks at the right/bottom edge.
The bf16 variant rounds the f32 product once to bf16 (round to nearest, ties to even), which is what
DeepSeek's own fp8 -> bf16 cast produces.
"""
from __future__ import annotations

import numpy as np
from ktlayouts.bf16 import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: F401  (the one bf16 rounding; re-exported)

# quantization_config of the FP8 releases: DeepSeek-V3 / R1 / V3.1 / V3.2 and Kimi-K2 write fmt "e4m3", MiniMax-M2
# "float8_e4m3fn" (the same format); V3.1+ add scale_fmt "ue8m0" (power-of-two scales, still stored as F32
# weight_scale_inv, read the same way); MiniMax lists modules_to_not_convert (they are simply BF16 tensors).
FP8_FMTS = ("e4m3", "float8_e4m3fn")
FP8_SCALE_FMTS = (None, "ue8m0")


def _e4m3fn_table() -> np.ndarray:
    """f32 value of every float8_e4m3fn bit pattern (1 sign, 4 exponent bits with bias 7, 3 mantissa bits).

    e4m3fn has no infinities; only S.1111.111 is NaN. Exponent 0 is subnormal: m * 2^-9.
    """
    bits = np.arange(256, dtype=np.uint32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp = (bits >> 3) & 0xF
    mant = (bits & 0x7).astype(np.float64)
    normal = (1.0 + mant / 8.0) * np.exp2(exp.astype(np.float64) - 7.0)
    subnormal = mant * 2.0**-9
    value = sign * np.where(exp == 0, subnormal, normal)
    value[(exp == 0xF) & ((bits & 0x7) == 0x7)] = np.nan
    return value.astype(np.float32)  # every value is exactly representable in f32


E4M3FN_TO_F32 = _e4m3fn_table()  # (256,) f32


def fp8_e4m3_to_f32(bits: np.ndarray) -> np.ndarray:
    """Decode uint8 float8_e4m3fn bit patterns to f32 (exact)."""
    return np.take(E4M3FN_TO_F32, np.asarray(bits, dtype=np.uint8))  # take: ~1.5x faster than fancy indexing


def expand_block_scales(scale_inv: np.ndarray, shape: tuple[int, int], block=(128, 128)) -> np.ndarray:
    """(ceil(N/bn), ceil(K/bk)) per-block scales -> (N, K) per-element scales (f32)."""
    n, k = shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight {shape} "
                         f"with blocks {tuple(block)}: expected {want}")
    s = np.asarray(scale_inv, dtype=np.float32)
    return np.repeat(np.repeat(s, bn, axis=0)[:n], bk, axis=1)[:, :k]


def dequant_fp8_block(w_fp8_bits: np.ndarray, scale_inv: np.ndarray, block=(128, 128)) -> np.ndarray:
    """FP8 weight bits (N, K) uint8, scales (ceil(N/bn), ceil(K/bk)) f32 -> (N, K) f32 = fp8 * scale (f32 product)."""
    w = np.asarray(w_fp8_bits)
    if w.dtype != np.uint8 or w.ndim != 2:
        raise ValueError(f"expected (N, K) uint8 float8_e4m3fn bits, got {w.dtype} {w.shape}")
    scales = expand_block_scales(np.asarray(scale_inv), w.shape, block)
    out = fp8_e4m3_to_f32(w)
    return np.multiply(out, scales, out=out)  # f32 * f32 -> f32, one IEEE rounding


def dequant_fp8_block_bf16_bits(w_fp8_bits: np.ndarray, scale_inv: np.ndarray, block=(128, 128)) -> np.ndarray:
    """Like dequant_fp8_block, then rounded once to bf16. Returns uint16 bf16 bit patterns (N, K)."""
    return f32_to_bf16_bits(dequant_fp8_block(w_fp8_bits, scale_inv, block))


def dequant_fp8_block_bf16(w_fp8_bits: np.ndarray, scale_inv: np.ndarray, block=(128, 128)):
    """Like dequant_fp8_block, rounded once to bf16, as a torch.bfloat16 tensor (N, K)."""
    import torch

    bits = dequant_fp8_block_bf16_bits(w_fp8_bits, scale_inv, block)
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def quantize_fp8_block(w: np.ndarray, block=(128, 128), pow2_scales: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """f32 weight (N, K) -> (float8_e4m3fn bits uint8 (N, K), scale_inv f32 (ceil(N/bn), ceil(K/bk))).

    The block's largest magnitude maps to 448 (the largest finite e4m3fn value), as DeepSeek's
    block quantizer does; pow2_scales rounds each scale up to a power of two (quantization_config scale_fmt
    "ue8m0", DeepSeek-V3.1 / V3.2: still stored as f32). Used by the fixture factory; rounding to fp8 goes through
    torch's cast.
    """
    import torch

    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = np.zeros((nb * bn, kb * bk), dtype=np.float32)
    padded[:n, :k] = w
    amax = np.abs(padded.reshape(nb, bn, kb, bk)).max(axis=(1, 3))  # (nb, kb)
    scale_inv = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    if pow2_scales:
        scale_inv = np.exp2(np.ceil(np.log2(scale_inv))).astype(np.float32)
    scaled = w / expand_block_scales(scale_inv, (n, k), block)
    bits = torch.from_numpy(np.ascontiguousarray(scaled)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return bits, scale_inv
