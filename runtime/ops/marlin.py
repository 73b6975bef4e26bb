"""Find an installed Marlin GEMM (W4A16 / W8A16, GPTQ-symmetric uint4b8 / uint8b128) and call it on our layout.

ktrun ships no CUDA code. vLLM and SGLang both expose `apply_gptq_marlin_linear(input, weight, weight_scale,
weight_zp, g_idx, g_idx_sort_indices, workspace, <type>, output_size_per_partition, input_size_per_partition,
is_k_full, ...)` next to helpers that build the workspace and empty g_idx / zero-point tensors. Our Marlin
qweight and scales are byte-identical to what their GPTQ-Marlin loaders produce (tests against tests/golden/,
copies of ../shared/golden/), so the kernel reads them as they are. The positional order and the name of the type
argument have changed between releases (`wtype` / `quant_type` / `num_bits`), so arguments are passed by name, chosen
from the installed function's signature.

KTRUN_MARLIN=off disables the kernel (the layer then dequantizes per call); KTRUN_MARLIN=vllm|sglang picks one.
"""
from __future__ import annotations

import importlib
import inspect
import os
from types import ModuleType

import torch

PROVIDERS = {
    "vllm": "vllm.model_executor.layers.quantization.utils.marlin_utils",
    "sglang": "sglang.srt.layers.quantization.marlin_utils",
}
SUPPORTED_GROUPS = (-1, 32, 64, 128)
TYPE_NAMES = {4: "uint4b8", 8: "uint8b128"}       # code - 2^(bits-1): our zero point convention
SKIPPED: dict[str, str] = {}                        # provider -> why its import failed (for `ktrun bench` / logs)


class MarlinKernel:
    """One provider module's apply_gptq_marlin_linear, adapted to MarlinLinear layers."""

    def __init__(self, provider: str, mod: ModuleType):
        self.provider, self.mod = provider, mod
        self.params = inspect.signature(mod.apply_gptq_marlin_linear).parameters
        self._workspaces: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"MarlinKernel({self.provider})"

    def supports(self, bits: int, group_size: int, dtype: torch.dtype) -> bool:
        return bits in TYPE_NAMES and group_size in SUPPORTED_GROUPS and dtype in (torch.float16, torch.bfloat16)

    def _workspace(self, device: torch.device, n_pad: int) -> torch.Tensor:
        """One zeroed int32 workspace per device (the kernel leaves it zeroed), sized for the newest API."""
        key = str(device)
        if key not in self._workspaces:
            if hasattr(self.mod, "marlin_make_workspace_new"):
                self._workspaces[key] = self.mod.marlin_make_workspace_new(device)
            else:       # older releases: (N / 64) * 16 ints per layer; size for the widest layer seen
                self._workspaces[key] = torch.zeros(max(n_pad // 64 * 16, 1 << 16), dtype=torch.int32, device=device)
        return self._workspaces[key]

    def prepare(self, layer) -> dict:
        """Per-layer constant arguments, built once at load."""
        dev = layer.qweight.device
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        kw = {"weight_zp": empty, "g_idx": empty, "g_idx_sort_indices": empty, "is_k_full": True,
              "workspace": self._workspace(dev, layer.n_pad),
              "output_size_per_partition": layer.n_pad, "input_size_per_partition": layer.k_pad}
        types = getattr(self.mod, "scalar_types", None)
        for name in ("wtype", "quant_type", "b_q_type"):
            if name in self.params and types is not None:
                kw[name] = getattr(types, TYPE_NAMES[layer.bits])
        if "num_bits" in self.params:
            kw["num_bits"] = layer.bits
        return {k: v for k, v in kw.items() if k in self.params}

    def __call__(self, layer, x: torch.Tensor) -> torch.Tensor:
        """x: (M, K_pad) in the layer's dtype -> (M, N_pad)."""
        return self.mod.apply_gptq_marlin_linear(input=x, weight=layer.qweight, weight_scale=layer.scales,
                                                 **layer.kernel_state)


def find_marlin_kernel(device: torch.device) -> MarlinKernel | None:
    """The first installed provider with apply_gptq_marlin_linear, on a CUDA device; None otherwise."""
    choice = os.environ.get("KTRUN_MARLIN", "auto").lower()
    if device.type != "cuda" or choice == "off":
        return None
    for provider, modname in PROVIDERS.items():
        if choice not in ("auto", provider):
            continue
        try:
            mod = importlib.import_module(modname)
        except (ImportError, OSError, RuntimeError) as e:   # absent, or built for another torch/CUDA: fall back
            SKIPPED[provider] = f"{type(e).__name__}: {e}"
            continue
        if callable(getattr(mod, "apply_gptq_marlin_linear", None)):
            return MarlinKernel(provider, mod)
    return None
