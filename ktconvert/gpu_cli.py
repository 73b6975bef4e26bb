"""Glue between the GPU-layer encoders (ktconvert.gpu_layers) and the converter: the encoder for a conversion's
options, the converted config.json, and the click options of `ktconvert quantize`.

Light to import (no torch): the CLI imports it to build its options; the encoders are imported when used."""
from __future__ import annotations

# method -> (algorithm, bits); bf16 leaves the non-expert tensors unquantized
GPU_METHODS = {"gptq-int4": ("gptq", 4), "rtn-int4": ("rtn", 4), "rtn-int8": ("rtn", 8), "bf16": None}
GPU_FORMATS = ("marlin", "gptq", "compressed-tensors")
GPU_METHOD_CHOICES = ("auto", *GPU_METHODS)
# ConvertOptions fields that select and configure the non-expert encoder (the arguments of dense_encoder_for)
GPU_OPTION_FIELDS = ("gpu_method", "gpu_group_size", "gpu_format", "calib", "quantize_head", "gpu_act_order")


def dense_encoder_for(src, gpu_method: str = "bf16", gpu_group_size: int = 128, gpu_format: str = "marlin",
                      calib: str | None = None, quantize_head: bool = False, gpu_act_order: bool = False):
    """The non-expert encoder of a conversion (ConvertOptions' gpu_* fields): bf16 or a GpuLayerEncoder."""
    from .dense_encoding import DENSE_ENCODERS, dense_encoder
    from .gpu_layers import GpuLayerEncoder, GpuLayerOptions

    if gpu_method == "bf16" or (gpu_method in DENSE_ENCODERS and gpu_method not in GPU_METHOD_CHOICES):
        return dense_encoder(gpu_method)
    return GpuLayerEncoder(GpuLayerOptions(method=gpu_method, group_size=gpu_group_size, fmt=gpu_format, calib=calib,
                                           quantize_head=quantize_head, act_order=gpu_act_order), src=src)


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


def gpu_click_options(command):
    """Decorator adding the GPU-layer options to a click command (as keyword arguments of the same names)."""
    import click

    options = [
        click.option("--gpu-method", type=click.Choice(GPU_METHOD_CHOICES), default="auto", show_default=True,
                     help="Non-expert Linears: auto = gptq-int4 when calibration text is available, else rtn-int4; "
                          "bf16 keeps them unquantized."),
        click.option("--gpu-group-size", type=click.Choice(["32", "64", "128", "-1"]), default="128",
                     show_default=True, callback=lambda _c, _p, v: int(v),
                     help="Input channels per GPU-layer scale (-1: one scale per output channel)."),
        click.option("--gpu-format", type=click.Choice(GPU_FORMATS), default="marlin", show_default=True,
                     help="marlin for ktrun; gptq / compressed-tensors write the quantization_config vLLM and "
                          "transformers read."),
        click.option("--calib", type=click.Path(dir_okay=False), default=None,
                     help="UTF-8 calibration text for GPTQ (default: the text shipped with ktconvert)."),
        click.option("--quantize-head", is_flag=True, help="Quantize lm_head too (off: it stays BF16)."),
        click.option("--gpu-act-order", is_flag=True,
                     help="GPTQ in order of decreasing Hessian diagonal (gptq format, or --gpu-group-size -1)."),
    ]
    for opt in reversed(options):
        command = opt(command)
    return command


def gpu_errors() -> tuple[type[Exception], ...]:
    """Exceptions of the GPU-layer path that mean bad input (the CLI prints them and exits 1)."""
    from .gptq import GptqError
    from .gpu_calib import CalibrationError
    from .gpu_layers import GpuLayerError

    return (GpuLayerError, CalibrationError, GptqError)
