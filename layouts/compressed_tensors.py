"""GPU layout `compressed-tensors` (format "pack-quantized", as written by llm-compressor, read by vLLM).

Same symmetric quantization as `gptq.py`; the codes are stored in Linear orientation:
    weight_packed: (N, K*bits/32) int32   32/bits consecutive K values per word, least significant bits first;
                   each value is the unsigned code, i.e. the signed value q in [-2^(b-1), 2^(b-1)) plus 2^(b-1)
    weight_scale:  (N, n_groups) float16
    weight_shape:  (2,) int64 = [N, K]
Dequantization: W[n, k] = (code - 2^(bits-1)) * weight_scale[n, k // G].
"""
from __future__ import annotations

import numpy as np

from .cpu_expert import LayoutError
from .gptq import GptqGeometry, pack_cols, stored_scales, unpack_cols


def ct_pack(codes_kn: np.ndarray, scales_gn: np.ndarray, geom: GptqGeometry, scale_dtype=np.float16
            ) -> dict[str, np.ndarray]:
    """codes (K, N) uint8, scales (n_groups, N) -> {weight_packed, weight_scale, weight_shape}.
    scale_dtype: float16 as llm-compressor writes them, or float32 to keep them exact."""
    if codes_kn.shape != (geom.k, geom.n) or scales_gn.shape != geom.scales_shape:
        raise LayoutError(f"codes {codes_kn.shape} / scales {scales_gn.shape} do not match {geom}")
    return {
        "weight_packed": pack_cols(np.ascontiguousarray(codes_kn.T), geom.bits),
        "weight_scale": np.ascontiguousarray(np.asarray(scales_gn, dtype=scale_dtype).T),
        "weight_shape": np.array([geom.n, geom.k], dtype=np.int64),
    }


def ct_unpack(tensors: dict[str, np.ndarray], geom: GptqGeometry) -> tuple[np.ndarray, np.ndarray]:
    """-> codes (K, N) uint8, scales (n_groups, N) float16 (float32 if so stored)."""
    shape = tensors.get("weight_shape")
    if shape is not None and tuple(int(x) for x in shape) != (geom.n, geom.k):
        raise LayoutError(f"weight_shape {list(shape)} != [N, K] = {[geom.n, geom.k]}")
    codes = unpack_cols(tensors["weight_packed"], geom.bits)
    if codes.shape != (geom.n, geom.k):
        raise LayoutError(f"weight_packed {tensors['weight_packed'].shape} does not match N={geom.n}, K={geom.k}")
    return np.ascontiguousarray(codes.T), np.ascontiguousarray(stored_scales(tensors["weight_scale"]).T)
