"""GPTQ checkpoints (AutoGPTQ / GPTQModel; read by vLLM and transformers) as a conversion source.

config.json `quantization_config`: {"quant_method": "gptq", "bits", "group_size" (-1: one group), "desc_act", "sym",
"checkpoint_format": "gptq" (v1) | "gptq_v2", "dynamic": {"+:regex" | "-:regex" | "regex": {overrides}}}.
A quantized Linear X (N outputs, K inputs) stores, little-endian:

    X.qweight  (K*b/32, N) I32     32/b consecutive K values per word, least significant bits first
    X.qzeros   (n_groups, N*b/32) I32   zero points packed along N the same way; v1 stores zero - 1
    X.scales   (n_groups, N) F16
    X.g_idx    (K,) I32             group of each input channel (needed when desc_act permuted them)

W[n, k] = (qweight[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]. Symmetric v1 checkpoints store zero 2^(b-1) - 1.
A `dynamic` entry "-:regex" leaves matching modules unquantized; "+:regex" (or a bare regex) overrides bits /
group_size / sym / desc_act for them (GPTQModel's rule: the first matching key wins, re.match on the module name).
"""
from __future__ import annotations

import re

import numpy as np
from ktlayouts.gptq import unpack_cols, unpack_rows

from ktconvert.sources.quantized.grid import IntGrid, contiguous_g_idx
from ktconvert.sources.quantized.scheme import QuantScheme, QuantTensorInfo, WeightFormat, scale_values
from ktconvert.sources.roles import SourceError

SUPPORTED_BITS = (4, 8)


class GptqScheme(QuantScheme):
    family = "gptq"
    parts = ("qweight", "qzeros", "scales", "g_idx")
    markers = ("qweight",)

    def __init__(self, qc: dict, where: str):
        super().__init__(qc, where)
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise SourceError(f"{self.field('checkpoint_format')} {fmt!r} is not supported (gptq or gptq_v2)")
        self.v1 = fmt == "gptq"
        dynamic = qc.get("dynamic") or {}
        if not isinstance(dynamic, dict):
            raise SourceError(f"{self.field('dynamic')} must be an object of regex -> overrides")
        self.dynamic = []
        for key, over in dynamic.items():
            sign, rx = (key[0], key[2:]) if key[:2] in ("+:", "-:") else ("+", key)
            try:
                self.dynamic.append((sign, re.compile(rx), over or {}))
            except re.error as e:
                raise SourceError(f"{self.field('dynamic')}: {key!r} is not a regex: {e}") from None

    def settings(self, module: str) -> dict:
        """bits, group_size, sym, desc_act of one module (`dynamic` overrides applied)."""
        s = {k: self.qc.get(k, d) for k, d in (("bits", None), ("group_size", 128), ("sym", True),
                                               ("desc_act", False))}
        for sign, rx, over in self.dynamic:
            if rx.match(module):
                if sign == "-":
                    return {}
                s.update({k: over[k] for k in s if k in over})
                s["override"] = rx.pattern
                break
        return s

    def describe(self, module, parts, read) -> QuantTensorInfo:
        qweight = self.need(parts, module, "qweight")
        s = self.settings(module)
        where = f"dynamic[{s['override']!r}]" if "override" in s else ""
        if not s:
            raise SourceError(f"{qweight.file}: tensor {qweight.name}: stored quantized, but "
                              f"{self.field('dynamic')} leaves {module} unquantized")
        bits, group = s["bits"], s["group_size"]
        if bits not in SUPPORTED_BITS:
            raise SourceError(f"{self.field(where or 'bits')}: bits {bits!r} is not supported "
                              f"({' or '.join(map(str, SUPPORTED_BITS))})")
        self.check(qweight, ("I32",), None, "packed codes")
        k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
        if not isinstance(group, int) or (group != -1 and group <= 0):
            raise SourceError(f"{self.field(where or 'group_size')} {group!r}: a positive group size or -1")
        glen = k if group == -1 else group
        ng = -(-k // glen)
        scales = self.need(parts, module, "scales")
        if scales.dtype not in ("F16", "BF16", "F32") or len(scales.shape) != 2 or scales.shape[1] != n:
            self.check(scales, ("F16", "BF16", "F32"), (ng, n), "scales (n_groups, N)")
        if scales.shape[0] != ng:
            raise SourceError(f"{scales.file}: tensor {scales.name}: {scales.shape[0]} scale groups disagree with "
                              f"{self.field(where or 'group_size')}={group} for {module} (K={k}): expected {ng}")
        qzeros = self.need(parts, module, "qzeros")
        self.check(qzeros, ("I32",), (ng, n * bits // 32), f"zero points packed along N, {32 // bits} per word")
        desc_act = bool(s["desc_act"])
        if "g_idx" in parts:
            self.check(parts["g_idx"], ("I32", "I64"), (k,), "group of each input channel")
        elif desc_act:
            raise SourceError(f"{qweight.file}: tensor {module}.g_idx is missing, but "
                              f"{self.field(where or 'desc_act')} is true: act-order groups cannot be recovered "
                              f"without it")
        fmt = WeightFormat(self.family, "int", bits, group, bool(s["sym"]), desc_act)
        return self.make_info(module, parts, (n, k), fmt)

    def decode(self, info: QuantTensorInfo, read) -> IntGrid:
        p, f = info.parts, info.fmt
        n, k = info.shape
        codes = unpack_rows(read(p["qweight"]), f.bits).astype(np.int16)          # (K, N)
        zeros = unpack_cols(read(p["qzeros"]), f.bits).astype(np.int16)[:, :n]    # (n_groups, N)
        if self.v1:
            zeros += 1              # v1 stores zero - 1 (a zero of 0 wraps to 2^b - 1 and reads back as 2^b)
        scales = scale_values(read(p["scales"]), p["scales"], "scale")            # (n_groups, N)
        ng = scales.shape[0]
        if "g_idx" in p:
            g_idx = read(p["g_idx"]).astype(np.int64)
            if g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= ng:
                gi = p["g_idx"]
                raise SourceError(f"{gi.file}: tensor {gi.name}: group indices outside [0, {ng})")
        else:
            g_idx = contiguous_g_idx(k, k if f.group == -1 else f.group)
        q = codes - zeros[g_idx]                                                   # (K, N)
        return IntGrid(np.ascontiguousarray(q.T), np.ascontiguousarray(scales.T), g_idx, f.label)
