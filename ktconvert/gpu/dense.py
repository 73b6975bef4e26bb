"""How non-expert tensors (attention, norms, router, shared experts, dense MLPs, embeddings, head) are encoded.

An encoder is registered under a method name (`--gpu-method`, default "bf16"). The pipeline first asks it for the
output tensors of each source tensor (`plan`, from the source's dtype and shape only, so file headers can be written
before any data is read), then streams one tensor at a time through `encode`. GPU-layer formats (GPTQ/Marlin, ...)
plug in by registering another encoder; each output carries its layout name, which goes into manifest.json.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from ktlayouts.bf16 import f32_to_bf16_bits
from ktlayouts.converted_dir import DENSE_LAYOUT_BF16, DENSE_LAYOUT_F32


@dataclass(frozen=True)
class DenseOutput:
    name: str                   # tensor name in the converted file (the hub name for bf16)
    dtype: str                  # safetensors dtype
    shape: tuple[int, ...]
    layout: str                 # layout name recorded in the manifest


class DenseEncoder(Protocol):
    name: str

    def plan(self, name: str, src_dtype: str, shape: tuple[int, ...], role) -> list[DenseOutput]: ...

    def encode(self, name: str, tensor: np.ndarray, role) -> dict[str, np.ndarray]:
        """tensor: float32 array of the source tensor -> {output name: array with the planned dtype/shape}."""
        ...


def _is_f32(src_dtype: str) -> bool:
    return str(src_dtype).upper().replace("TORCH.", "") in ("F32", "FLOAT32", "FLOAT")


class Bf16Encoder:
    """Every tensor as BF16 under its hub name; router weights and score-correction biases stay F32 if they are, and
    "kept" tensors (DeepSeek-V4's hyper-connection mixers, sinks, tid2eid ...) are F32 (integers exactly)."""
    name = "bf16"

    def __init__(self):
        self._f32_names: set[str] = set()     # planned as F32, so encode matches plan exactly

    def plan(self, name, src_dtype, shape, role):
        if (role.kind in ("router", "router_bias", "shared_expert_gate") and _is_f32(src_dtype)) or role.kind == "kept":
            self._f32_names.add(name)
            return [DenseOutput(name, "F32", tuple(shape), DENSE_LAYOUT_F32)]
        return [DenseOutput(name, "BF16", tuple(shape), DENSE_LAYOUT_BF16)]

    def encode(self, name, tensor, role):
        a = np.ascontiguousarray(tensor, dtype=np.float32)
        return {name: a if name in self._f32_names else f32_to_bf16_bits(a)}


DENSE_ENCODERS: dict[str, Callable[[], DenseEncoder]] = {"bf16": Bf16Encoder}


def register_dense_encoder(method: str, factory: Callable[[], DenseEncoder]) -> None:
    DENSE_ENCODERS[method] = factory


def dense_encoder(method: str) -> DenseEncoder:
    if method not in DENSE_ENCODERS:
        raise ValueError(f"unknown GPU-layer method {method!r}; available: {', '.join(sorted(DENSE_ENCODERS))}")
    return DENSE_ENCODERS[method]()
