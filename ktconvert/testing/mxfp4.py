"""MXFP4 as gpt-oss's releases store experts (the fixture writer's encoder; the reader is ktconvert.sources
.fused_experts, tested against transformers' own decoder): per row, blocks of 32 values share an E8M0 scale
2^(e - 127); each value is the nearest E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the even code) times the
scale, two per byte with the lower index in the low nibble. The scale puts the block's largest magnitude in [4, 8)
(clipped to 6), as the OCP MX spec's conversion does."""
from __future__ import annotations

import numpy as np

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (..., N, K) float, K a multiple of 32 -> (blocks (..., N, K/32, 16) uint8, scales (..., N, K/32) uint8)."""
    w = np.asarray(w, dtype=np.float32)
    *lead, k = w.shape
    if k % 32:
        raise ValueError(f"MXFP4 rows need K a multiple of 32, got {k}")
    b = w.reshape(*lead, k // 32, 32)
    amax = np.abs(b).max(axis=-1)
    e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127).astype(np.int32)
    e = np.clip(e, -127, 127)
    v = np.abs(b) / np.ldexp(np.float32(1), e)[..., None]
    codes = np.abs(v[..., None] - E2M1_MAGNITUDES).argmin(axis=-1).astype(np.uint8)   # nearest; ties: lower code
    codes |= np.where((b < 0) & (codes > 0), 8, 0).astype(np.uint8)
    pairs = codes.reshape(*lead, k // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return blocks, (e + 127).astype(np.uint8)
