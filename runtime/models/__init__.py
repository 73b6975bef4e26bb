"""Model forwards (torch) for the families ktrun serves: one module per attention + routing combination with its
attention, router and cache widths; `model.MoEModel` runs any of them over per-request caches. Which module runs
which family is the family's `runtime_module` in the registry (ktlayouts.families)."""
from __future__ import annotations

import importlib

from ktlayouts.families import get_family


def arch_module(model_type: str):
    """The forward module of a family (model_type: its name or an alias); ConfigError for an unknown one."""
    return importlib.import_module(f"{__name__}.{get_family(model_type).runtime_module}")
