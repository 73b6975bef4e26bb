"""Defaults that more than one part of ktrun (and ktconvert) uses, each written once here. Torch-free: the command
lines import it before anything heavy."""
from __future__ import annotations

# The context limit of `ktrun generate` / `serve` (and the Engine) without --ctx, in tokens.
DEFAULT_CTX = 4096

# Tokens of KV cache a hot-expert plan leaves free on the GPU when neither --kv-mem nor --ctx says otherwise: one
# sequence of DEFAULT_CTX tokens (`ktconvert quantize|inspect --gpu-mem`, `ktrun bench`, load_model's default).
KV_BUDGET_TOKENS = DEFAULT_CTX

# Tokens in the dynamic hot-expert placement's frequency window (`--dynamic-window`).
DYNAMIC_WINDOW_TOKENS = 2048

# How GPU-quantized Linears are placed (`--gpu-weights`; ktrun.dense_placement).
GPU_WEIGHT_POLICIES = ("auto", "packed", "dequant", "kernels")

# Requests `ktrun serve` runs at once (`--max-batch`, the Engine's max_batch).
DEFAULT_MAX_BATCH = 16

# Sampling of an API request that names no temperature / top_p: the OpenAI API's documented defaults (the server's
# routes). The Python API (SamplingParams, `ktrun generate`) is greedy unless asked (temperature 0.0).
API_TEMPERATURE = 1.0
API_TOP_P = 1.0
