"""GPU layout `gptq` (AutoGPTQ / GPTQModel checkpoint format, v1 zero convention).

A Linear weight W is (N, K) (N outputs, K inputs). GPU formats quantize it symmetrically per group of G consecutive
input channels (G = 32, 64, 128, or -1 for one group spanning all of K):

    W[n, k] ~= (code[k, n] - Z) * scale[g_idx[k], n]        Z = 2^(bits-1): uint4b8 / uint8b128

Codes are kept in (K, N) orientation ("kn"), the orientation of every GPU format here.
Tensors (all little-endian):
    qweight: (K*bits/32, N) int32   32/bits consecutive K values per word, least significant bits first
    qzeros:  (n_groups, N*bits/32) int32   stored zero point minus one (v1 convention: Z-1 = 7 / 127),
                                           packed along N, least significant bits first
    scales:  (n_groups, N) float16
    g_idx:   (K,) int32   group of each input channel: k // G, or a permuted order after act-order GPTQ
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cpu_expert import LayoutError

GPU_BITS = (4, 8)
GPU_GROUP_SIZES = (32, 64, 128, -1)


def zero_point(bits: int) -> int:
    return 1 << (bits - 1)


def check_bits(bits: int) -> None:
    if bits not in GPU_BITS:
        raise LayoutError(f"GPU layouts support 4 or 8 bits, got {bits}")


def pack_factor(bits: int) -> int:
    check_bits(bits)
    return 32 // bits


@dataclass(frozen=True)
class GptqGeometry:
    """Sizes of one (N, K) Linear in the GPTQ layout."""
    n: int
    k: int
    bits: int
    group_size: int    # 32, 64, 128 or -1

    def __post_init__(self):
        check_bits(self.bits)
        if self.group_size not in GPU_GROUP_SIZES:
            raise LayoutError(f"GPU group size must be one of {GPU_GROUP_SIZES}, got {self.group_size}")
        if self.n <= 0 or self.k <= 0:
            raise LayoutError(f"cannot quantize an empty matrix of shape ({self.n}, {self.k})")
        if self.k % self.group or self.k % pack_factor(self.bits):
            raise LayoutError(f"K={self.k} is not a multiple of the group size {self.group_size}")
        if self.n % pack_factor(self.bits):
            raise LayoutError(f"N={self.n} is not a multiple of {pack_factor(self.bits)} (qzeros packing)")

    @property
    def group(self) -> int:
        return self.k if self.group_size == -1 else self.group_size

    @property
    def n_groups(self) -> int:
        return self.k // self.group

    @property
    def qweight_shape(self) -> tuple[int, int]:
        return (self.k * self.bits // 32, self.n)

    @property
    def qzeros_shape(self) -> tuple[int, int]:
        return (self.n_groups, self.n * self.bits // 32)

    @property
    def scales_shape(self) -> tuple[int, int]:
        return (self.n_groups, self.n)

    @property
    def nbytes(self) -> int:
        """qweight + qzeros + scales (fp16) + g_idx bytes."""
        qw = self.qweight_shape[0] * self.qweight_shape[1] * 4
        qz = self.qzeros_shape[0] * self.qzeros_shape[1] * 4
        return qw + qz + self.n_groups * self.n * 2 + self.k * 4

    def default_g_idx(self) -> np.ndarray:
        return (np.arange(self.k) // self.group).astype(np.int32)


def group_size_for(k: int, n_groups: int, what: str = "weight") -> int:
    """The group size of K input channels stored with `n_groups` scale groups (-1 for one group)."""
    if n_groups <= 0 or k % n_groups:
        raise LayoutError(f"{what}: {n_groups} scale groups do not divide K={k}")
    return -1 if n_groups == 1 else k // n_groups


def _checked_codes(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """values as a 2-D array of codes that fit `bits` bits, packable along `axis` (0: rows, 1: columns)."""
    v = np.asarray(values)
    f = pack_factor(bits)
    if v.ndim != 2 or v.shape[axis] % f:
        raise LayoutError(f"cannot pack {v.shape} along {('rows', 'columns')[axis]} in words of {f} values")
    if v.size:
        lo, hi = int(v.min()), int(v.max())
        if hi >= (1 << bits) or lo < 0:
            raise LayoutError(f"code {hi if lo >= 0 else lo} does not fit in {bits} bits")
    return v


def _or_words(parts, bits: int) -> np.ndarray:
    """parts[i]: the i-th value of every word (same shape) -> words, value i at bits i*bits.. (LSB first). One
    uint32 accumulator: no (values x f) uint32 temporary (the converter packs matrices of 10^8 codes)."""
    out = parts[0].astype(np.uint32)
    for i in range(1, len(parts)):
        out |= parts[i].astype(np.uint32) << np.uint32(i * bits)
    return out.view(np.int32)


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """(R, C) unsigned codes -> (R*bits/32, C) int32: word [r, c] holds rows r*f .. r*f+f-1, LSB first."""
    f = pack_factor(bits)
    v = _checked_codes(values, bits, 0)
    v = v.reshape(v.shape[0] // f, f, v.shape[1])
    return _or_words([v[:, i] for i in range(f)], bits)


def unpack_rows(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of pack_rows: (R/f, C) int32 -> (R, C) uint8."""
    f = pack_factor(bits)
    w = np.asarray(words).view(np.uint32)
    shifts = (np.arange(f, dtype=np.uint32) * bits)[None, :, None]
    v = (w[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)
    return v.reshape(w.shape[0] * f, w.shape[1]).astype(np.uint8)


def pack_cols(values: np.ndarray, bits: int) -> np.ndarray:
    """(R, C) unsigned codes -> (R, C*bits/32) int32, consecutive columns LSB first (pack_rows of the transpose,
    transposed back)."""
    f = pack_factor(bits)
    v = _checked_codes(values, bits, 1)
    v = v.reshape(v.shape[0], v.shape[1] // f, f)
    return np.ascontiguousarray(_or_words([v[:, :, i] for i in range(f)], bits))


def unpack_cols(words: np.ndarray, bits: int) -> np.ndarray:
    return np.ascontiguousarray(unpack_rows(np.ascontiguousarray(np.asarray(words).T), bits).T)


def stored_scales(scales: np.ndarray) -> np.ndarray:
    """Scales as read: float16 (the formats' dtype), or float32 where they were stored so (exact expert export)."""
    s = np.asarray(scales)
    return s if s.dtype == np.float32 else s.astype(np.float16, copy=False)


def gptq_pack(codes_kn: np.ndarray, scales_gn: np.ndarray, geom: GptqGeometry,
              g_idx: np.ndarray | None = None, scale_dtype=np.float16) -> dict[str, np.ndarray]:
    """codes (K, N) uint8, scales (n_groups, N) -> {qweight, qzeros, scales, g_idx} in the GPTQ v1 layout.
    scale_dtype: float16 as GPTQ checkpoints store them, or float32 to keep them exact."""
    if codes_kn.shape != (geom.k, geom.n):
        raise LayoutError(f"codes shape {codes_kn.shape} != (K, N) = {(geom.k, geom.n)}")
    if scales_gn.shape != geom.scales_shape:
        raise LayoutError(f"scales shape {scales_gn.shape} != {geom.scales_shape}")
    zeros = np.full((geom.n_groups, geom.n), zero_point(geom.bits) - 1, dtype=np.uint32)
    g = geom.default_g_idx() if g_idx is None else np.asarray(g_idx, dtype=np.int32)
    if g.shape != (geom.k,) or g.min() < 0 or g.max() >= geom.n_groups:
        raise LayoutError(f"g_idx must be ({geom.k},) with values in [0, {geom.n_groups})")
    return {
        "qweight": pack_rows(codes_kn, geom.bits),
        "qzeros": pack_cols(zeros, geom.bits),
        "scales": np.ascontiguousarray(scales_gn, dtype=scale_dtype),
        "g_idx": g,
    }


def gptq_unpack(tensors: dict[str, np.ndarray], geom: GptqGeometry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> codes (K, N) uint8, scales (n_groups, N) float16 (float32 if so stored), g_idx (K,) int32. Checks the
    zero points."""
    zeros = unpack_cols(tensors["qzeros"], geom.bits).astype(np.int32) + 1
    if zeros.shape != (geom.n_groups, geom.n) or np.any(zeros != zero_point(geom.bits)):
        raise LayoutError(f"qzeros are not the symmetric v1 zero point {zero_point(geom.bits) - 1}")
    g = tensors.get("g_idx")
    g = geom.default_g_idx() if g is None else np.asarray(g, dtype=np.int32)
    return unpack_rows(tensors["qweight"], geom.bits), stored_scales(tensors["scales"]), g


def dequantize_kn(codes_kn: np.ndarray, scales_gn: np.ndarray, g_idx: np.ndarray, bits: int) -> np.ndarray:
    """-> W (N, K) float32 in Linear orientation."""
    q = codes_kn.astype(np.float32) - zero_point(bits)
    return np.ascontiguousarray((q * scales_gn.astype(np.float32)[g_idx]).T)
