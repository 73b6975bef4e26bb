"""GPU-layer methods and formats, and the click options of `ktconvert quantize` that choose them.

Light to import (no torch): the CLI imports it to build its options."""
from __future__ import annotations

from ktlayouts.constants import DEFAULT_GPU_GROUP_SIZE
from ktlayouts.gpu_formats import format_families

# method -> (algorithm, bits); bf16 leaves the non-expert tensors unquantized
# rtn: vLLM's reference rule (scale max|w| / ((2^b - 1) / 2)); search: per-group scale search minimizing the squared
# error weighted by calibration importance (ktconvert.scale_search); gptq: GPTQ with that scale search
GPU_METHODS = {"gptq-int4": ("gptq", 4), "gptq-int8": ("gptq", 8), "search-int4": ("search", 4), "search-int8": ("search", 8),
               "rtn-int4": ("rtn", 4), "rtn-int8": ("rtn", 8), "bf16": None}
GPU_FORMATS = format_families()          # the registered GPU Linear formats: marlin, gptq, compressed-tensors
GPU_METHOD_CHOICES = ("auto", *GPU_METHODS)
# ConvertOptions fields that select and configure the non-expert encoder (the arguments of dense_encoder_for)
GPU_OPTION_FIELDS = ("gpu_method", "gpu_group_size", "gpu_format", "calib", "quantize_head", "gpu_act_order",
                     "calib_tokens", "gpu_method_for", "gpu_mix_budget", "gpu_mix_method")
# --gpu-mix-budget with --gpu-method auto: added bits per GPU-layer weight the measured rule may spend (sensitivity).
# 0.5, not 1: on the CPU path every GPU-layer byte is read each token, and at 1 the Qwen3-30B-A3B-shaped model of
# bench_vs_llamacpp.py decoded 5.7% slower than without the upgrades (docs/quantization.md, "Why budget 0.5")
DEFAULT_MIX_BUDGET = 0.5



def _rules_option(_ctx, _param, value):
    import click

    from ktconvert.gpu.mix import MixError, parse_rules
    try:
        return parse_rules(value, GPU_METHODS)
    except MixError as e:
        raise click.BadParameter(str(e)) from None


def gpu_click_options(command):
    """Decorator adding the GPU-layer options to a click command (as keyword arguments of the same names)."""
    import click

    options = [
        click.option("--gpu-method", type=click.Choice(GPU_METHOD_CHOICES), default="auto", show_default=True,
                     help="Non-expert Linears: auto = gptq-int4 when calibration text is available (with the measured "
                          "int8 upgrades of --gpu-mix-budget), else rtn-int4; "
                          "search-int4/8 = round to nearest with importance-weighted scale search; rtn = vLLM's "
                          "reference rule; bf16 keeps them unquantized."),
        click.option("--gpu-method-for", "gpu_method_for", multiple=True, metavar="GLOB=METHOD",
                     callback=_rules_option,
                     help="Repeatable: give the non-expert Linears whose tensor name matches GLOB (fnmatch, with or "
                          "without .weight) METHOD instead of --gpu-method; the first matching rule wins. E.g. "
                          "--gpu-method-for 'model.layers.0.mlp.down_proj=gptq-int8' --gpu-method-for "
                          "'*.kv_b_proj=bf16'. A pattern that matches no quantized Linear is refused."),
        click.option("--gpu-mix-budget", type=click.FloatRange(0), default=None,
                     help="Mixed precision by measured sensitivity: a calibration pass measures how much quantizing "
                          "each non-expert Linear alone disturbs its layer's output, then the ones that hurt most "
                          "per added bit get --gpu-mix-method, up to this many added bits per GPU-layer weight "
                          f"[default: {DEFAULT_MIX_BUDGET:g} with --gpu-method auto, else 0 = off]. E.g. "
                          "--gpu-method gptq-int4 --gpu-mix-budget 0.5."),
        click.option("--gpu-mix-method", type=click.Choice([m for m, a in GPU_METHODS.items() if a and a[1] == 8]),
                     default="gptq-int8", show_default=True,
                     help="What --gpu-mix-budget upgrades the sensitive Linears to, e.g. --gpu-mix-method "
                          "search-int8."),
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
