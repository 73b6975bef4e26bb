"""FP8 checkpoints with one scale per output channel or per tensor (not DeepSeek's 128x128 blocks).

quant_method "fp8" without `weight_block_size` (transformers' / vLLM's per-tensor serialization) and "fbgemm_fp8"
(per channel): a Linear X stores X.weight (N, K) F8_E4M3 and X.weight_scale: () or (1,) [per tensor], (N,) or
(N, 1) [per output channel]; W = fp8(weight) * scale in float32. Activation scales (input_scale) are dropped.
DeepSeek's block format (weight_scale_inv) stays with the checkpoint reader (ktconvert.sources.fp8).
"""
from __future__ import annotations

import numpy as np

from ktconvert.sources.fp8 import fp8_e4m3_to_f32
from ktconvert.sources.quantized.scheme import QuantScheme, QuantTensorInfo, WeightFormat, scale_values
from ktconvert.sources.roles import SourceError


class Fp8ScaledScheme(QuantScheme):
    family = "fp8"
    parts = ("weight", "weight_scale", "input_scale", "input_scale_ub")
    markers = ("weight_scale",)

    def logical_tensors(self, infos, names, read):
        kept = [n for n in names if not n.endswith((".input_scale", ".input_scale_ub"))]
        return super().logical_tensors(infos, kept, read)

    def describe(self, module, parts, read) -> QuantTensorInfo:
        w = self.need(parts, module, "weight", "the FP8 weight belongs beside its weight_scale")
        self.check(w, ("F8_E4M3",), None, "float8_e4m3fn weight")
        if len(w.shape) != 2:
            raise SourceError(f"{w.file}: tensor {w.name}: FP8 weight must be 2-D, got shape {list(w.shape)}")
        n, k = w.shape
        s = parts["weight_scale"]
        self.check(s, ("F32", "BF16", "F16"), None, "scale")
        shape = tuple(s.shape)
        if shape in ((), (1,), (1, 1)):
            group = 0
        elif shape in ((n,), (n, 1)):
            group = -1
        else:
            raise SourceError(f"{s.file}: tensor {s.name}: shape {list(shape)} is neither one scale per tensor "
                              f"([] or [1]) nor one per output channel ([{n}] or [{n}, 1]) for {module} [{n}, {k}]")
        return self.make_info(module, parts, (n, k), WeightFormat(self.family, "fp8", 8, group))

    def decode(self, info: QuantTensorInfo, read) -> np.ndarray:
        p = info.parts
        scale = scale_values(read(p["weight_scale"]), p["weight_scale"], "scale").reshape(-1, 1)
        return fp8_e4m3_to_f32(read(p["weight"])) * scale
