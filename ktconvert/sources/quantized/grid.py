"""The integer grid of an already-quantized weight, and where it fits one of our layouts exactly.

Every integer format we read (compressed-tensors int, GPTQ, AWQ, GGUF Q8_0/Q4_0, and MXFP4, whose E2M1 values times
two are integers) reduces to one form:

    W[n, k] = q[n, k] * scale[n, g_idx[k]]          q: small integers (zero point already subtracted), in float32

A target layout (ours: symmetric, zero point Z = 2^(b-1), one scale per G consecutive input channels) holds W exactly
when (1) every q fits in [-2^(b-1), 2^(b-1) - 1], (2) every run of G consecutive input channels uses one source
scale (the source group is a multiple of G, or act-order g_idx happens to be constant there), and (3) the target
stores the scale values unchanged (checked by the caller on its own storage: CPU tiles, float16 GPU scales).
Then codes = q + Z and scales are the source's scale values, repeated per target group: the dequantized values
are the same float32 numbers, with no rounding anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class IntGrid:
    """One (N, K) weight as integers times per-group scales (see the module docstring)."""
    q: np.ndarray          # (N, K) int16: signed values, zero point subtracted
    scales: np.ndarray     # (N, n_groups) float32: exact scale values
    g_idx: np.ndarray      # (K,) int64: group of each input channel (k // G unless act order permuted it)
    what: str              # the source format, for the log ("compressed-tensors int4 g32")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> np.ndarray:
        """-> W (N, K) float32: q * scale, one float32 product per value (exact for 16-bit scales)."""
        n, k = self.q.shape
        ng = self.scales.shape[1]
        if ng and k % ng == 0 and np.array_equal(self.g_idx, np.arange(k) // (k // ng)):
            w = self.q.astype(np.float32).reshape(n, ng, k // ng)
            w *= self.scales[:, :, None]
            return w.reshape(n, k)
        return self.q.astype(np.float32) * self.scales[:, self.g_idx]


def contiguous_g_idx(k: int, group: int) -> np.ndarray:
    """g_idx of groups of `group` consecutive input channels (group = K: one scale per row)."""
    return np.arange(k, dtype=np.int64) // group


def target_scales(grid: IntGrid, group: int) -> tuple[np.ndarray | None, str]:
    """The grid's scales as one per `group` consecutive input channels (N, K / group), or (None, why not)."""
    k = grid.shape[1]
    if group <= 0 or k % group:
        return None, f"K={k} is not a multiple of group {group}"
    runs = grid.g_idx.reshape(k // group, group)
    if not np.all(runs == runs[:, :1]):
        return None, f"the source's scale groups do not cover whole groups of {group} input channels"
    return grid.scales[:, runs[:, 0]], ""


def fits_bits(grid: IntGrid, bits: int) -> tuple[bool, str]:
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    qmin, qmax = int(grid.q.min(initial=0)), int(grid.q.max(initial=0))
    if qmin < lo or qmax > hi:
        return False, f"its integers reach outside int{bits}'s [{lo}, {hi}]"
    return True, ""


def symmetric_codes(grid: IntGrid, bits: int, group: int) -> tuple[tuple[np.ndarray, np.ndarray] | None, str]:
    """(codes (N, K) uint8 with zero point 2^(bits-1), scales (N, K / group) float32) holding the grid exactly in a
    symmetric `bits`-bit layout with groups of `group`; or (None, why not)."""
    ok, why = fits_bits(grid, bits)
    if not ok:
        return None, why
    scales, why = target_scales(grid, group)
    if scales is None:
        return None, why
    codes = (grid.q + (1 << (bits - 1))).astype(np.uint8)
    return (codes, np.ascontiguousarray(scales, dtype=np.float32)), ""
