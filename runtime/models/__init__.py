"""Model forwards (torch) for the architectures ktrun serves: one module per architecture with its attention,
router and weight-name prefixes; `model.MoEModel` runs any of them over per-request caches."""
from __future__ import annotations

import importlib

ARCH_MODULES = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral")


def arch_module(model_type: str):
    if model_type not in ARCH_MODULES:
        raise ValueError(f"model_type {model_type!r} is not supported; ktrun runs {list(ARCH_MODULES)}")
    return importlib.import_module(f"{__name__}.{model_type}")
