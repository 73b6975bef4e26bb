"""CPU dequantization of every GPU-layer format (ktlayouts.marlin / .gptq / .compressed_tensors), from the stored
tensors alone: geometry is derived from their shapes, padding removed with `weight_shape`.

Used by ktrun when there is no GPU (the quantized weights run as float matmuls) and by `ktconvert verify --against`.
"""
from __future__ import annotations

import re

import numpy as np
from ktlayouts.compressed_tensors import ct_unpack
from ktlayouts.cpu_expert import LayoutError
from ktlayouts.gptq import GptqGeometry, dequantize_kn, gptq_unpack
from ktlayouts.marlin import marlin_unpack, qweight_kn

# tensor suffixes of one quantized Linear, per format
FORMAT_PARTS = {
    "marlin": ("qweight", "scales", "weight_shape"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape"),
}
_LAYOUT_RE = re.compile(r"^gpu-(marlin|gptq|compressed-tensors)-int(4|8)$")


def parse_layout(layout: str) -> tuple[str, int]:
    """'gpu-marlin-int4' -> ('marlin', 4)."""
    m = _LAYOUT_RE.match(layout)
    if not m:
        raise LayoutError(f"{layout!r} is not a GPU-layer layout (gpu-{{marlin,gptq,compressed-tensors}}-int{{4,8}})")
    return m.group(1), int(m.group(2))


def _group_size(k: int, n_groups: int, what: str) -> int:
    if n_groups <= 0 or k % n_groups:
        raise LayoutError(f"{what}: {n_groups} scale groups do not divide K={k}")
    return -1 if n_groups == 1 else k // n_groups


def _crop(w: np.ndarray, shape, what: str) -> np.ndarray:
    if shape is None:
        return w
    n, k = (int(x) for x in np.asarray(shape).reshape(-1))
    if n > w.shape[0] or k > w.shape[1]:
        raise LayoutError(f"{what}: weight_shape {[n, k]} exceeds the stored {list(w.shape)}")
    return np.ascontiguousarray(w[:n, :k])


def dequantize_linear(layout: str, parts: dict[str, np.ndarray], what: str = "weight") -> np.ndarray:
    """parts: {suffix: array} of one Linear (e.g. {'qweight':..., 'scales':..., 'weight_shape':...}) -> W (N, K) f32."""
    fmt, bits = parse_layout(layout)
    missing = [p for p in FORMAT_PARTS[fmt] if p not in parts and p != "g_idx"]
    if missing:
        raise LayoutError(f"{what}: {layout} needs tensors {missing}")
    if fmt == "marlin":
        qw = parts["qweight"]
        k, n = qweight_kn(qw.shape, bits)
        geom = GptqGeometry(n, k, bits, _group_size(k, parts["scales"].shape[0], what))
        codes, scales = marlin_unpack(parts, geom)
        w = dequantize_kn(codes, scales, geom.default_g_idx(), bits)
        return _crop(w, parts.get("weight_shape"), what)
    if fmt == "gptq":
        qw = parts["qweight"]
        k, n = qw.shape[0] * 32 // bits, qw.shape[1]
        geom = GptqGeometry(n, k, bits, _group_size(k, parts["scales"].shape[0], what))
        codes, scales, g_idx = gptq_unpack(parts, geom)
        return dequantize_kn(codes, scales, g_idx, bits)
    wp = parts["weight_packed"]
    n, k = wp.shape[0], wp.shape[1] * 32 // bits
    geom = GptqGeometry(n, k, bits, _group_size(k, parts["weight_scale"].shape[1], what))
    codes, scales = ct_unpack(parts, geom)
    return _crop(dequantize_kn(codes, scales, geom.default_g_idx(), bits), parts.get("weight_shape"), what)


def dequantize_named(layout: str, tensors: dict[str, np.ndarray], weight_name: str) -> np.ndarray:
    """tensors of a converted file (by full name), the hub weight name 'X.weight' -> W (N, K) float32."""
    base = weight_name.removesuffix(".weight")
    fmt, _ = parse_layout(layout)
    parts = {p: tensors[f"{base}.{p}"] for p in FORMAT_PARTS[fmt] if f"{base}.{p}" in tensors}
    return dequantize_linear(layout, parts, what=weight_name)


def quantized_linears(names, layouts: dict[str, str]) -> dict[str, str]:
    """Output tensor names + their layouts -> {hub weight name 'X.weight': layout} of the quantized Linears."""
    out = {}
    for name in names:
        layout = layouts.get(name, "")
        if _LAYOUT_RE.match(layout):
            fmt, _ = parse_layout(layout)
            base, _, part = name.rpartition(".")
            if part == FORMAT_PARTS[fmt][0]:
                out[f"{base}.weight"] = layout
    return out


# Limits on ||W_hat - W|| / ||W|| that `verify --against` applies to GPU-layer weights. INT4 GPTQ trades weight
# error for output error (measured 0.10-0.20 on the fixtures); a wrong layout or scale gives ~1 or more.
GPU_MAX_REL_ERROR = {4: 0.35, 8: 0.05}


def max_rel_error(layout: str) -> float:
    return GPU_MAX_REL_ERROR[parse_layout(layout)[1]]
