"""bfloat16 as bit patterns (uint16) in numpy, which has no bfloat16 dtype: the one rounding every writer uses.

float32 -> bf16 rounds to nearest, ties to even (what torch's `.to(torch.bfloat16)` and the hardware converters
do); infinities stay infinities, values beyond the largest bf16 round to infinity, and NaN stays a (quiet) NaN
with its sign. bf16 -> float32 is exact (the 16 bits become the high half of the float32); round_to_bf16 is the
composition (float32 values on the bf16 grid, e.g. scales a bf16-scale format takes over exactly).
"""
from __future__ import annotations

import numpy as np

BF16_QUIET_NAN_BIT = 0x0040        # the top mantissa bit of a bf16


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """x (any shape, any float dtype; cast to float32 first) -> bf16 bit patterns, uint16, same shape."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    # adding < 0x8000 overflows uint32 only for patterns >= 0xFFFF8000, all NaN; every NaN is redone below
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | BF16_QUIET_NAN_BIT).astype(np.uint16)   # quiet NaN, sign kept
    return rounded


def bf16_bits_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bf16 bit patterns (uint16 or int16, any shape) -> float32 (exact). out: a C-contiguous float32 array of the
    same shape to write into (a reused buffer: no fresh pages to fault in), else a new one."""
    b = np.asarray(bits).view(np.uint16)
    if out is None:
        out = np.empty(b.shape, np.float32)
    elif out.shape != b.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 of shape {b.shape}, got {out.dtype} {out.shape}")
    # the 16 bits become the high half of each word: one pass, widened in the ufunc's buffer
    np.left_shift(b, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded (nearest even) to the nearest bfloat16, as float32 (same shape)."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))
