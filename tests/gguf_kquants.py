"""Q4_K and Q6_K blocks built from their published bit layout (ggml's block_q4_K / block_q6_K), for tests.

gguf-py can dequantize these types but not quantize them, so tests build blocks here from chosen integer codes and
scales, and know the exact values the blocks stand for without running any dequantizer:
- Q4_K (256 values, 144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks of 32, 128 bytes of
  nibbles (bytes 32i..32i+31: low nibbles = sub-block 2i, high nibbles = sub-block 2i+1). value = d*sc*q - dmin*m.
- Q6_K (256 values, 210 bytes): ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16] (one per 16 values), f16 d.
  value = d * scale * (q - 32).
"""
from __future__ import annotations

import numpy as np

QK_K = 256


def q4_k_blocks(rng: np.random.Generator, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes (n_blocks, 144) uint8, expected values (n_blocks, 256) float32)."""
    d = (rng.uniform(0.5, 1.5, n_blocks) / 63 / 15 * 0.2).astype(np.float16)
    dmin = (rng.uniform(0.5, 1.5, n_blocks) / 63 * 0.1).astype(np.float16)
    sc = rng.integers(0, 64, (n_blocks, 8))
    mn = rng.integers(0, 64, (n_blocks, 8))
    q = rng.integers(0, 16, (n_blocks, 8, 32))
    scales = np.zeros((n_blocks, 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).astype(np.uint8).reshape(n_blocks, 128)
    raw = np.concatenate([d.view(np.uint8).reshape(n_blocks, 2), dmin.view(np.uint8).reshape(n_blocks, 2),
                          scales, qs], axis=1)
    values = (d.astype(np.float32)[:, None, None] * sc[..., None] * q
              - dmin.astype(np.float32)[:, None, None] * mn[..., None])
    return raw, values.reshape(n_blocks, QK_K).astype(np.float32)


def q6_k_blocks(rng: np.random.Generator, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes (n_blocks, 210) uint8, expected values (n_blocks, 256) float32)."""
    d = (rng.uniform(0.5, 1.5, n_blocks) / 127 / 32 * 0.2).astype(np.float16)
    sc = rng.integers(-128, 128, (n_blocks, 16)).astype(np.int8)
    q = rng.integers(0, 64, (n_blocks, QK_K))                     # 6-bit codes, value uses q - 32
    ql = np.zeros((n_blocks, 128), np.uint8)
    qh = np.zeros((n_blocks, 64), np.uint8)
    for half in range(2):                                          # each half: 128 values, ql 64 bytes, qh 32 bytes
        v = q[:, 128 * half: 128 * (half + 1)]
        a, b, c, e = v[:, 0:32], v[:, 32:64], v[:, 64:96], v[:, 96:128]
        ql[:, 64 * half: 64 * half + 32] = (a & 0xF) | ((c & 0xF) << 4)
        ql[:, 64 * half + 32: 64 * half + 64] = (b & 0xF) | ((e & 0xF) << 4)
        qh[:, 32 * half: 32 * half + 32] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    raw = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n_blocks, 2)], axis=1)
    values = d.astype(np.float32)[:, None] * np.repeat(sc.astype(np.float32), 16, axis=1) * (q - 32)
    return raw, values.astype(np.float32)
