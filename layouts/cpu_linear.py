"""CPU dense-Linear layouts cpu-linear-int4 / cpu-linear-int8 (spec: README.md "CPU dense Linears").

A non-expert Linear W (N, K) (attention projections, shared experts, dense MLPs, lm_head) for libktkernels' linear
op. Its bytes are exactly those of ONE cpu-expert-int4/int8 matrix, so the geometry is cpu_expert.MatrixGeometry
and the kernels run the routed experts' inner loops on it:

    qweight: (N_pad/16, K_pad/64, tile_bytes) uint8     tile_bytes 512 (int4) / 1024 (int8)
    scales:  (N_pad/16, n_groups, 16) float32, or float16 (scale_dtype "f16": the GPU layers' float16 scales
             moved as they are, half the bytes; the kernels widen them to float32 exactly, so results are the same)
    W[n, k] = (code[n, k] - Z) * scale[n, k // G]       Z = 2^(bits-1) (8 / 128), G = 32, 64m, or -1 (per row)

The quantization is the GPU layers' (ktlayouts.gptq: same symmetric codes, same zero point, groups 32/64/128/-1 of
consecutive input channels), so a conversion's GPU codes become CPU tiles without requantization:
`repack_gpu_codes` moves the codes and widens the float16 scales to float32 (exact), or keeps them float16.
libktkernels' kt_linear_repack(_ex) does the same in C++ at load time; this module is its reference.
"""
from __future__ import annotations

import numpy as np

from .constants import CPU_LINEAR_LAYOUTS, GROUP_PER_ROW
from .cpu_expert import (
    LayoutError,
    MatrixGeometry,
    pack_codes,
    pack_expert_matrix,
    pack_scales,
    unpack_codes,
    unpack_scales,
)
from .expert_formats import UNDECLARED_SCALE_DTYPE, scale_encodings


def layout_name(bits: int) -> str:
    """4 -> 'cpu-linear-int4'."""
    for name, (b, _) in CPU_LINEAR_LAYOUTS.items():
        if b == bits:
            return name
    raise LayoutError(f"no cpu-linear layout for {bits} bits (4 or 8)")


def linear_geometry(n: int, k: int, bits: int, group_size: int,
                    scale_dtype: str = UNDECLARED_SCALE_DTYPE) -> MatrixGeometry:
    """Geometry of one (N, K) Linear: a single cpu-expert matrix (int4 / int8 only); scales f32 or f16 (the scale
    encodings the kernels' dense Linear op reads, ScaleEncoding.dense_linear)."""
    if bits not in (4, 8):
        raise LayoutError(f"cpu-linear layouts are int4 or int8, got {bits} bits")
    if scale_dtype not in linear_scale_dtypes():
        raise LayoutError(f"cpu-linear scales are {' or '.join(linear_scale_dtypes())}, got {scale_dtype!r}")
    return MatrixGeometry(n=n, k=k, bits=bits, group_size=group_size, scale_dtype=scale_dtype)


def linear_scale_dtypes() -> tuple[str, ...]:
    """The scale dtypes of the cpu-linear layouts: f32, f16."""
    return tuple(r.name for r in scale_encodings() if r.dense_linear)


def gpu_group_count(geom: MatrixGeometry) -> int:
    """Scale groups of the unpadded K (the GPU layouts' n_groups): K / G, or 1 per row."""
    return 1 if geom.group_size == GROUP_PER_ROW else -(-geom.k // geom.group)


# --- pack / unpack ------------------------------------------------------------------------------

def pack_linear(w: np.ndarray, geom: MatrixGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Float weights (N, K) -> (qweight, scales), quantized as the routed experts are (cpu_expert.quantize). For
    Linears that have no GPU codes; a converted GPU layer goes through repack_gpu_codes instead."""
    return pack_expert_matrix(w, geom)


def pack_linear_codes(codes_nk: np.ndarray, scales_ng: np.ndarray, geom: MatrixGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Codes (N, K) uint8 (zero point Z), scales (N, gpu_group_count) float -> (qweight, scales float32), padded
    with code Z and scale 0."""
    ng = gpu_group_count(geom)
    if codes_nk.shape != (geom.n, geom.k) or scales_ng.shape != (geom.n, ng):
        raise LayoutError(f"codes {codes_nk.shape} / scales {scales_ng.shape} do not fit {geom}: expected "
                          f"({geom.n}, {geom.k}) / ({geom.n}, {ng})")
    c = np.full((geom.n_pad, geom.k_pad), geom.format.zero_point, dtype=np.uint8)
    c[: geom.n, : geom.k] = codes_nk
    s = np.zeros((geom.n_pad, geom.n_groups), dtype=np.float32)
    s[: geom.n, :ng] = scales_ng
    return pack_codes(c, geom), pack_scales(s, geom)


def unpack_linear_codes(qweight: np.ndarray, scales: np.ndarray, geom: MatrixGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of pack_linear_codes: -> codes (N, K) uint8, scales (N, gpu_group_count) float32."""
    codes = unpack_codes(qweight, geom)[: geom.n, : geom.k]
    return np.ascontiguousarray(codes), np.ascontiguousarray(unpack_scales(scales, geom)[: geom.n, : gpu_group_count(geom)])


def unpack_linear(qweight: np.ndarray, scales: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """Packed tensors -> dequantized W (N, K) float32: (code - Z) * scale, one float32 product per weight."""
    codes, s = unpack_linear_codes(qweight, scales, geom)
    q = codes.astype(np.float32) - np.float32(geom.format.zero_point)
    return q * np.repeat(s, geom.group, axis=1)[:, : geom.k]


# --- GPU codes <-> CPU tiles --------------------------------------------------------------------

def repack_gpu_codes(codes_kn: np.ndarray, scales_gn: np.ndarray, bits: int, group_size: int,
                     scale_dtype: str = UNDECLARED_SCALE_DTYPE) -> tuple[MatrixGeometry, np.ndarray, np.ndarray]:
    """GPU codes -> CPU tiles, bit-exact (the reference of libktkernels' kt_linear_repack).

    codes_kn: (K, N) uint8 with zero point 2^(bits-1) (ktlayouts.gptq convention: gptq_unpack, ct_unpack and
    marlin_unpack all give this), scales_gn: (n_groups, N) float16 (n_groups = K / G, or 1 for G = -1).
    -> (geometry, qweight, scales float32, or float16 with scale_dtype "f16"). The zero points are the same, so
    codes are only moved; float16 widens to float32 exactly (or stays float16). Act-order (permuted g_idx) weights must be reordered first: the groups here are k // G.
    """
    codes_kn, scales_gn = np.asarray(codes_kn), np.asarray(scales_gn)
    if codes_kn.ndim != 2 or codes_kn.dtype != np.uint8:
        raise LayoutError(f"GPU codes must be (K, N) uint8, got {codes_kn.dtype} {codes_kn.shape}")
    k, n = codes_kn.shape
    geom = linear_geometry(n, k, bits, group_size, scale_dtype)
    if group_size != GROUP_PER_ROW and k % group_size:
        raise LayoutError(f"K={k} is not a multiple of the GPU group size {group_size}")
    if scales_gn.dtype != np.float16 or scales_gn.shape != (gpu_group_count(geom), n):
        raise LayoutError(f"GPU scales must be ({gpu_group_count(geom)}, {n}) float16, got {scales_gn.dtype} "
                          f"{scales_gn.shape}")
    if codes_kn.max(initial=0) >= 1 << bits:
        raise LayoutError(f"int{bits} GPU codes must be in 0..{(1 << bits) - 1}")
    qweight, scales = pack_linear_codes(codes_kn.T, scales_gn.T.astype(np.float32), geom)
    return geom, qweight, scales


def to_gpu_codes(qweight: np.ndarray, scales: np.ndarray, geom: MatrixGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of repack_gpu_codes: -> codes (K, N) uint8, scales (n_groups, N) float16. Refuses scales that float16
    cannot hold exactly (a Linear quantized on the CPU side with float32 scales)."""
    codes, s = unpack_linear_codes(qweight, scales, geom)
    s16 = s.astype(np.float16)
    if not np.array_equal(s16.astype(np.float32), s):
        raise LayoutError("scales are not exactly representable in float16: not a repacked GPU layer")
    return np.ascontiguousarray(codes.T), np.ascontiguousarray(s16.T)
