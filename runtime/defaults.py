"""Defaults that more than one part of ktrun (and ktconvert) uses, each written once here. Torch-free: the command
lines import it before anything heavy."""
from __future__ import annotations

# Tokens of KV cache a hot-expert plan leaves free on the GPU when no --kv-mem / --ctx says otherwise: one sequence of
# 4096 tokens (`ktconvert quantize|inspect --gpu-mem`, `ktrun bench`, load_model's default).
KV_BUDGET_TOKENS = 4096

# The context limit of `ktrun generate` / `serve` without --ctx.
DEFAULT_CTX = 4096

# How GPU-quantized Linears are placed (`--gpu-weights`; ktrun.dense_placement).
GPU_WEIGHT_POLICIES = ("auto", "packed", "dequant", "kernels")

# Sampling temperature of a request that names none. The OpenAI API's documented default is 1.0, so the server's
# routes use it; the Python API (SamplingParams, `ktrun generate`) is greedy unless asked.
API_TEMPERATURE = 1.0
GREEDY_TEMPERATURE = 0.0
