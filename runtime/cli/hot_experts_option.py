"""The hot-expert options and their one parser, shared by `ktrun generate|bench|serve` and (without the dynamic ones)
`ktconvert quantize`, which writes the placement into the conversion. Torch-free: imported by the CLIs before torch
loads."""
from __future__ import annotations

import click
from ktlayouts.expert_gpu import HOT_FORMATS
from ktlayouts.expert_placement import DEFAULT_STRATEGY, STRATEGIES

from ..byte_sizes import parse_bytes
from ..defaults import DYNAMIC_WINDOW_TOKENS, KV_BUDGET_TOKENS


def hot_experts_options(dynamic: bool = True):
    """Decorator adding --profile, --gpu-experts, --gpu-experts-ratio, --gpu-mem, --kv-mem, --placement,
    --gpu-expert-format (and, for ktrun, --dynamic-experts, --dynamic-window) to a click command; dynamic=False:
    the options of `ktconvert quantize`, which writes the placement into the conversion."""
    kv_default = (f"KV of --ctx tokens, x --max-batch for serve, {KV_BUDGET_TOKENS} for bench" if dynamic
                  else f"{KV_BUDGET_TOKENS} tokens of one sequence")
    auto = "marlin when a Marlin kernel is installed, else bf16" if dynamic else "marlin when the codes fit it"
    opts = [
        click.option("--profile", "hot_profile", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Expert activation profile (ktconvert profile) that chooses the hot experts."),
        click.option("--gpu-experts", "hot_per_layer", type=click.IntRange(0), default=None,
                     help="Hot experts on the GPU per MoE layer (0: none, also ignoring a placement written into "
                          "the conversion)."),
        click.option("--gpu-experts-ratio", "hot_ratio", type=click.FloatRange(0, 1), default=None,
                     help="Share of all routed experts on the GPU."),
        click.option("--gpu-mem", "hot_gpu_mem", default=None, metavar="SIZE",
                     help="GPU memory to fill with hot experts after the dense layers, the KV budget and a 5% "
                          "reserve, e.g. 24GB."),
        click.option("--kv-mem", "hot_kv_mem", default=None, metavar="SIZE",
                     help=f"KV-cache budget that --gpu-mem leaves free (default: {kv_default})."),
        click.option("--placement", "hot_strategy", type=click.Choice(STRATEGIES), default=DEFAULT_STRATEGY,
                     show_default=True,
                     help="uniform: the same number per layer; frequency: the most-called (layer, expert) pairs; "
                          "per-layer: the budget spread by held-out-validated hit gain per byte."),
        click.option("--gpu-expert-format", "hot_format", type=click.Choice(("auto", *HOT_FORMATS)), default="auto",
                     show_default=True,
                     help=f"How hot experts are held: marlin (the tiles' int codes, exact) or bf16; auto: {auto}."),
    ]
    if dynamic:
        opts += [
            click.option("--dynamic-experts", "hot_dynamic", is_flag=True,
                         help="Keep the hot set fresh while running: windowed counts with hysteresis, swaps copied "
                              "into a spare slot off the critical path and flipped between steps."),
            click.option("--dynamic-window", "hot_window", type=click.IntRange(1), default=DYNAMIC_WINDOW_TOKENS,
                         show_default=True,
                         help="Tokens in the dynamic placement's frequency window."),
        ]

    def decorate(f):
        for o in reversed(opts):
            f = o(f)
        return f
    return decorate


def hot_experts_from(kw: dict, written: bool = False):
    """Pop the hot_* options of a click command's kwargs -> ktrun.experts.placement.HotExpertOptions, or None when
    none was given (for ktrun: a placement written into the conversion then applies). written=True: `ktconvert
    quantize`'s rule, a placement written into the conversion needs --profile and exactly one budget."""
    from ..experts.placement import Budget, HotExpertOptions, PlacementError

    profile, n, ratio = kw.pop("hot_profile", None), kw.pop("hot_per_layer", None), kw.pop("hot_ratio", None)
    gpu_mem, kv_mem = kw.pop("hot_gpu_mem", None), kw.pop("hot_kv_mem", None)
    strategy, fmt = kw.pop("hot_strategy", DEFAULT_STRATEGY), kw.pop("hot_format", "auto")
    dynamic, window = kw.pop("hot_dynamic", False), kw.pop("hot_window", DYNAMIC_WINDOW_TOKENS)
    try:
        budget = Budget(n, ratio, parse_bytes(gpu_mem, "--gpu-mem") if gpu_mem else None,
                        parse_bytes(kv_mem, "--kv-mem") if kv_mem else None)
    except PlacementError as e:
        raise click.UsageError(str(e)) from None
    asked = profile is not None or budget.given
    if written and asked and (profile is None or not budget.given):
        raise click.UsageError("a placement written into the conversion needs --profile P and one of --gpu-experts, "
                               "--gpu-experts-ratio and --gpu-mem")
    if not (asked or (not written and (dynamic or fmt != "auto"))):
        return None
    return HotExpertOptions(profile=profile, budget=budget, strategy=strategy, gpu_format=fmt, dynamic=dynamic,
                            window=window)
