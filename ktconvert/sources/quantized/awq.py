"""AWQ checkpoints (AutoAWQ, GEMM kernel layout; read by vLLM and transformers) as a conversion source.

config.json `quantization_config`: {"quant_method": "awq", "bits": 4, "group_size", "zero_point": true,
"version": "gemm", "modules_to_not_convert": [...]}. A quantized Linear X (N outputs, K inputs) stores:

    X.qweight  (K, N/8) I32         8 output channels per word, nibble i holding channel 8c + AWQ_ORDER[i]
    X.qzeros   (K/G, N/8) I32       unsigned zero points, packed the same way
    X.scales   (K/G, N) F16

W[n, k] = (qweight[k, n] - qzeros[k // G, n]) * scales[k // G, n]: asymmetric, so the signed integers span
[-15, 15] and fit int8 (not int4) exactly.
"""
from __future__ import annotations

import numpy as np

from ktconvert.sources.quantized.grid import IntGrid, contiguous_g_idx
from ktconvert.sources.quantized.scheme import QuantScheme, QuantTensorInfo, WeightFormat, scale_values
from ktconvert.sources.roles import SourceError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)       # output channel (within a word's 8) held by nibble i


def unpack_awq(words: np.ndarray) -> np.ndarray:
    """(R, C/8) int32 in AWQ order -> (R, C) int16 unsigned 4-bit values in channel order."""
    w = np.asarray(words).view(np.uint32)
    nib = (w[:, :, None] >> (np.arange(8, dtype=np.uint32) * 4)) & np.uint32(0xF)   # (R, C/8, nibble)
    out = np.empty_like(nib)
    out[:, :, list(AWQ_ORDER)] = nib
    return out.reshape(w.shape[0], -1).astype(np.int16)


class AwqScheme(QuantScheme):
    family = "awq"
    parts = ("qweight", "qzeros", "scales")
    markers = ("qweight",)

    def __init__(self, qc: dict, where: str):
        super().__init__(qc, where)
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise SourceError(f"{self.field('version')} {qc.get('version')!r} is not supported (the GEMM layout "
                              f"'gemm' only)")
        if qc.get("bits", qc.get("w_bit", 4)) != 4:
            raise SourceError(f"{self.field('bits')} {qc.get('bits')!r}: AWQ checkpoints are 4-bit")
        if not qc.get("zero_point", True):
            raise SourceError(f"{self.field('zero_point')} false is not supported (AutoAWQ GEMM stores zero points)")
        self.group = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(self.group, int) or (self.group <= 0 and self.group != -1):
            raise SourceError(f"{self.field('group_size')} {self.group!r}: a positive group size or -1")

    def describe(self, module, parts, read) -> QuantTensorInfo:
        qweight = self.need(parts, module, "qweight")
        self.check(qweight, ("I32",), None, "packed codes")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        glen = k if self.group == -1 else self.group
        ng = -(-k // glen)
        scales = self.need(parts, module, "scales")
        self.check(scales, ("F16", "BF16", "F32"), None, "scales")
        if len(scales.shape) != 2 or scales.shape[1] != n or scales.shape[0] != ng:
            raise SourceError(f"{scales.file}: tensor {scales.name}: shape {list(scales.shape)} disagrees with "
                              f"{self.field('group_size')}={self.group} for {module} (K={k}, N={n}): expected "
                              f"{[ng, n]}")
        self.check(self.need(parts, module, "qzeros"), ("I32",), (ng, n // 8), "zero points, 8 per word")
        return self.make_info(module, parts, (n, k), WeightFormat(self.family, "int", 4, self.group, False))

    def decode(self, info: QuantTensorInfo, read) -> IntGrid:
        p, f = info.parts, info.fmt
        k = info.shape[1]
        codes = unpack_awq(read(p["qweight"]))                                    # (K, N)
        zeros = unpack_awq(read(p["qzeros"]))                                     # (n_groups, N)
        scales = scale_values(read(p["scales"]), p["scales"], "scale")
        g_idx = contiguous_g_idx(k, k if f.group == -1 else f.group)
        return IntGrid(np.ascontiguousarray((codes - zeros[g_idx]).T), np.ascontiguousarray(scales.T), g_idx,
                       f.label)
