"""The `--gpu-weights` option shared by `ktrun generate`, `serve` and `bench` (torch-free: imported by the CLI)."""
from __future__ import annotations

import click

from ..defaults import GPU_WEIGHT_POLICIES

gpu_weights_option = click.option(
    "--gpu-weights", type=click.Choice(GPU_WEIGHT_POLICIES), default="auto", show_default=True,
    help="GPU-quantized Linears: 'kernels' (CPU) repacks them once at load for the CPU kernels' quantized Linear "
         "op (int4/int8 read per token, no float copy); 'packed' keeps Marlin-layout weights packed on the device "
         "and runs them with an installed Marlin kernel (vLLM or SGLang; else dequantized per call); 'dequant' dequantizes them once at "
         "load; 'auto': packed with a kernel on CUDA, else dequant when it fits in half the free GPU memory "
         "(on the CPU: kernels when the library loads, else dequant).")
