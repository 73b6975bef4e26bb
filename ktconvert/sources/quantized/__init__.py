"""Already-quantized checkpoints as conversion sources: compressed-tensors, GPTQ, AWQ, FP8 with per-channel or
per-tensor scales, MXFP4 / MXFP8 / NVFP4 (compressed-tensors' formats).

`scheme_for(quantization_config, where)` binds a checkpoint's config to its reader (None: unquantized, or DeepSeek's
FP8 blocks, which ktconvert.sources.checkpoint reads itself). The checkpoint reader then shows every quantized
Linear as one logical `X.weight` (scheme.QuantTensorInfo), reads it dequantized to float32 exactly as the format
defines it, and offers its integer grid (grid.IntGrid) where it has one, so the converter can take codes and scales
over unchanged where our layouts hold them (ktconvert.exact_paths).
"""
from __future__ import annotations

from ktconvert.sources.fp8 import FP8_FMTS, FP8_SCALE_FMTS
from ktconvert.sources.quantized.awq import AwqScheme
from ktconvert.sources.quantized.compressed_tensors import CompressedTensorsScheme
from ktconvert.sources.quantized.deepseek_v4 import DeepseekV4Scheme
from ktconvert.sources.quantized.fp8_scaled import Fp8ScaledScheme
from ktconvert.sources.quantized.gptq import GptqScheme
from ktconvert.sources.quantized.grid import IntGrid
from ktconvert.sources.quantized.scheme import QuantScheme, QuantTensorInfo, WeightFormat
from ktconvert.sources.roles import SourceError

__all__ = ["SUPPORTED_METHODS", "IntGrid", "QuantScheme", "QuantTensorInfo", "WeightFormat", "scheme_for"]

SCHEMES = {"compressed-tensors": CompressedTensorsScheme, "gptq": GptqScheme, "awq": AwqScheme,
           "fbgemm_fp8": Fp8ScaledScheme}
SUPPORTED_METHODS = ("fp8 (DeepSeek blocks, per channel, per tensor)", *SCHEMES)


def scheme_for(qc: dict | None, where: str) -> QuantScheme | None:
    """The reader of a checkpoint's quantization_config; None for no config and for DeepSeek FP8 blocks
    (`weight_block_size`, read by the checkpoint reader); SourceError naming the field for anything else."""
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise SourceError(f"{where}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") not in FP8_FMTS:
            raise SourceError(f"{where}: unsupported quantization_config (quant_method='fp8', fmt={qc.get('fmt')!r}):"
                              f" quantization_config.fmt must be one of {', '.join(FP8_FMTS)}")
        if qc.get("scale_fmt") not in FP8_SCALE_FMTS:
            raise SourceError(f"{where}: unsupported quantization_config (quant_method='fp8', "
                              f"scale_fmt={qc.get('scale_fmt')!r}): quantization_config.scale_fmt must be absent or "
                              f"{', '.join(f for f in FP8_SCALE_FMTS if f)}")
        if qc.get("expert_dtype") is not None:      # DeepSeek-V4: FP8 blocks + FP4 experts, scales under X.scale
            return DeepseekV4Scheme(qc, where)
        return None if "weight_block_size" in qc else Fp8ScaledScheme(qc, where)
    cls = SCHEMES.get(method)
    if cls is None:
        raise SourceError(f"{where}: unsupported quantization_config (quant_method={method!r}): "
                          f"quantization_config.quant_method must be one of {', '.join(SUPPORTED_METHODS)}")
    return cls(qc, where)
