"""GPU-layer methods and formats, and the click options of `ktconvert quantize` that choose them.

Light to import (no torch): the CLI imports it to build its options."""
from __future__ import annotations

from ktlayouts.constants import DEFAULT_GPU_GROUP_SIZE
from ktlayouts.gpu_formats import format_families

# method -> (algorithm, bits); bf16 leaves the non-expert tensors unquantized
# rtn: vLLM's reference rule (scale max|w| / ((2^b - 1) / 2)); search: per-group scale search minimizing the squared
# error weighted by calibration importance (ktconvert.scale_search); gptq: GPTQ with that scale search
GPU_METHODS = {"gptq-int4": ("gptq", 4), "search-int4": ("search", 4), "search-int8": ("search", 8),
               "rtn-int4": ("rtn", 4), "rtn-int8": ("rtn", 8), "bf16": None}
GPU_FORMATS = format_families()          # the registered GPU Linear formats: marlin, gptq, compressed-tensors
GPU_METHOD_CHOICES = ("auto", *GPU_METHODS)
# ConvertOptions fields that select and configure the non-expert encoder (the arguments of dense_encoder_for)
GPU_OPTION_FIELDS = ("gpu_method", "gpu_group_size", "gpu_format", "calib", "quantize_head", "gpu_act_order",
                     "calib_tokens")


def gpu_click_options(command):
    """Decorator adding the GPU-layer options to a click command (as keyword arguments of the same names)."""
    import click

    options = [
        click.option("--gpu-method", type=click.Choice(GPU_METHOD_CHOICES), default="auto", show_default=True,
                     help="Non-expert Linears: auto = gptq-int4 when calibration text is available, else rtn-int4; "
                          "search-int4/8 = round to nearest with importance-weighted scale search; rtn = vLLM's "
                          "reference rule; bf16 keeps them unquantized."),
        click.option("--gpu-group-size", type=click.Choice(["32", "64", "128", "-1"]),
                     default=str(DEFAULT_GPU_GROUP_SIZE),
                     show_default=True, callback=lambda _c, _p, v: int(v),
                     help="Input channels per GPU-layer scale (-1: one scale per output channel)."),
        click.option("--gpu-format", type=click.Choice(GPU_FORMATS), default="marlin", show_default=True,
                     help="marlin for ktrun; gptq / compressed-tensors write the quantization_config vLLM and "
                          "transformers read."),
        click.option("--calib", type=click.Path(dir_okay=False), default=None,
                     help="UTF-8 calibration text for GPTQ (default: the text shipped with ktconvert)."),
        click.option("--calib-tokens", type=click.IntRange(1), default=2048, show_default=True,
                     help="Calibration tokens (windows of 256) for GPTQ and importance, GPU layers and experts."),
        click.option("--quantize-head", is_flag=True, help="Quantize lm_head too (off: it stays BF16)."),
        click.option("--gpu-act-order", is_flag=True,
                     help="GPTQ in order of decreasing Hessian diagonal (gptq format, or --gpu-group-size -1)."),
    ]
    for opt in reversed(options):
        command = opt(command)
    return command
