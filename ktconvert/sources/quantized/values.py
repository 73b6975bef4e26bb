"""Element and scale encodings of the float formats: E2M1 (FP4), E4M3 (FP8, in ktconvert.sources.fp8), E8M0.

E2M1 (OCP MX / NVFP4): 1 sign bit (bit 3), 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Times two they are the integers 0, 1, 2, 3, 4, 6, 8, 12, which is why MXFP4 fits an int8 grid exactly.
Two E2M1 values per byte, the element with the lower index in the low nibble.
E8M0 (MX scales): an unsigned biased exponent, value 2^(e - 127); e = 255 is NaN.
"""
from __future__ import annotations

import numpy as np

E2M1_TIMES_TWO = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)  # by nibble
E8M0_BIAS = 127
E8M0_NAN = 255


def unpack_e2m1_times_two(packed: np.ndarray, k: int) -> np.ndarray:
    """(N, ceil(K/2)) uint8 -> (N, K) int16 = 2 * E2M1 value (low nibble first)."""
    p = np.asarray(packed, dtype=np.uint8)
    nib = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], -1)[:, :k]
    return np.take(E2M1_TIMES_TWO, nib)


def e8m0_exponents(e: np.ndarray) -> np.ndarray:
    """uint8 biased exponents -> int32 unbiased exponents (NaN codes are the caller's to refuse)."""
    return np.asarray(e, dtype=np.int32) - E8M0_BIAS


def pow2(exponents: np.ndarray) -> np.ndarray:
    """2^e as float32, exact (subnormal down to 2^-149)."""
    return np.ldexp(np.float32(1), np.asarray(exponents, dtype=np.int32)).astype(np.float32)
