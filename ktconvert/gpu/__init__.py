"""The GPU-layer wing: every non-expert Linear as GPTQ or RTN INT4/INT8 (Marlin, GPTQ or compressed-tensors
layout) or BF16. options (methods, formats, CLI options), dense (the encoder protocol and BF16), rtn, gptq, calib
(layer-by-layer calibration), encoder (GpuLayerEncoder), evaluate (what GPTQ buys, for tests and bench).

Light to import: the encoders (torch) are imported when used."""
from __future__ import annotations

from ktlayouts.constants import DEFAULT_GPU_GROUP_SIZE

from ktconvert.gpu.options import GPU_METHOD_CHOICES, GPU_OPTION_FIELDS

__all__ = ["GPU_OPTION_FIELDS", "converted_config_json", "dense_encoder_for", "gpu_errors"]


def dense_encoder_for(src, gpu_method: str = "bf16", gpu_group_size: int = DEFAULT_GPU_GROUP_SIZE, gpu_format: str = "marlin",
                      calib: str | None = None, quantize_head: bool = False, gpu_act_order: bool = False,
                      calib_tokens: int = 2048, gpu_method_for: tuple = (), gpu_mix_budget: float | None = None,
                      gpu_mix_method: str = "gptq-int8"):
    """The non-expert encoder of a conversion (ConvertOptions' gpu_* fields): bf16 or a GpuLayerEncoder."""
    from ktconvert.gpu.dense import DENSE_ENCODERS, dense_encoder
    from ktconvert.gpu.encoder import GpuLayerEncoder, GpuLayerOptions

    if (gpu_method == "bf16" and not gpu_method_for) or (gpu_method in DENSE_ENCODERS
                                                         and gpu_method not in GPU_METHOD_CHOICES):
        return dense_encoder(gpu_method)
    return GpuLayerEncoder(GpuLayerOptions(method=gpu_method, group_size=gpu_group_size, fmt=gpu_format, calib=calib,
                                           quantize_head=quantize_head, act_order=gpu_act_order,
                                           calib_tokens=calib_tokens, method_for=tuple(gpu_method_for),
                                           mix_budget=mix_budget_for(gpu_method, gpu_mix_budget),
                                           mix_method=gpu_mix_method), src=src)


def mix_budget_for(gpu_method: str, budget: float | None) -> float:
    """--gpu-mix-budget as given, or its default: DEFAULT_MIX_BUDGET with --gpu-method auto, else 0 (off)."""
    from ktconvert.gpu.options import DEFAULT_MIX_BUDGET

    if budget is not None:
        return float(budget)
    return DEFAULT_MIX_BUDGET if gpu_method == "auto" else 0.0


def converted_config_json(raw: bytes, encoder) -> bytes:
    """config.json for the converted directory: the source's quantization_config (FP8) replaced by the GPU
    layers' one (gptq / compressed-tensors formats), or removed."""
    import json

    cfg = json.loads(raw)
    qc = encoder.quantization_config() if hasattr(encoder, "quantization_config") else None
    if "quantization_config" not in cfg and qc is None:
        return raw
    cfg.pop("quantization_config", None)
    if qc is not None:
        cfg["quantization_config"] = qc
    return (json.dumps(cfg, indent=2) + "\n").encode()


def gpu_errors() -> tuple[type[Exception], ...]:
    """Exceptions of the GPU-layer path that mean bad input (the CLI prints them and exits 1)."""
    from ktconvert.gpu.calib import CalibrationError
    from ktconvert.gpu.encoder import GpuLayerError
    from ktconvert.gpu.gptq import GptqError

    return (GpuLayerError, CalibrationError, GptqError)
