"""Shared fixtures of the kernel tests: tiny packed MoE layers built with ktlayouts, and a numpy reference of
the routed-expert computation that follows layouts/README.md independently of libktkernels."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from ktlayouts.cpu_expert import (
    MatrixGeometry,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    pack_expert_matrix,
    quantize_activations,
    unpack_expert_matrix,
)
from ktlayouts.expert_shards import ShardPlan
from ktrun.ops.library import BACKENDS, backend_supported
from ktrun.ops.moe import ExpertShard


def backend_params() -> list:
    """Every backend; the ones this CPU lacks are skipped visibly (AMX on anything but Sapphire Rapids+)."""
    return [pytest.param(b, marks=[pytest.mark.amx] if b == "amx" else [])
            if backend_supported(b) else
            pytest.param(b, marks=pytest.mark.skip(reason=f"CPU lacks the {b} backend (cpuid/XCR0/AMX permission)"))
            for b in BACKENDS]


class PackedLayer:
    """Random experts of one layer: float weights, their packed shards and the dequantized shards."""

    def __init__(self, rng: np.random.Generator, n_experts: int, hidden: int, inter: int, bits: int,
                 group_size: int, n_shards: int = 1, scale_dtype: str = "f32"):
        self.E, self.H, self.I, self.bits, self.G = n_experts, hidden, inter, bits, group_size
        self.plan = ShardPlan(intermediate=inter, group_size=group_size, n_shards=n_shards, bits=bits,
                              scale_dtype=scale_dtype if bits != 16 else "f32")
        ip = self.plan.intermediate_pad
        w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
        gate, up, down = (np.zeros((n_experts, ip, hidden), np.float32), np.zeros((n_experts, ip, hidden), np.float32),
                          np.zeros((n_experts, hidden, ip), np.float32))
        gate[:, :inter], up[:, :inter], down[:, :, :inter] = w(n_experts, inter, hidden), w(n_experts, inter, hidden), \
            w(n_experts, hidden, inter)
        self.shards, self.deq, self.geoms = [], [], []
        for s in range(n_shards):
            i0, i1 = self.plan.shard_range(s)
            gu, dn = self.plan.gate_up_geometry(s, hidden), self.plan.down_geometry(s, hidden)
            if bits != 16:
                gu, dn = replace(gu, scale_dtype=scale_dtype), replace(dn, scale_dtype=scale_dtype)
            packed, deq = {}, {}
            for name, full, geom in (("gate", gate[:, i0:i1], gu), ("up", up[:, i0:i1], gu),
                                     ("down", down[:, :, i0:i1], dn)):
                qs = [pack_expert_matrix(full[e], geom) for e in range(n_experts)]
                packed[name] = (np.stack([q for q, _ in qs]),
                                None if bits == 16 else np.stack([sc for _, sc in qs]))
                deq[name] = np.stack([unpack_expert_matrix(q, sc, geom) for q, sc in qs]).astype(np.float64)
            self.shards.append(ExpertShard(*packed["gate"], *packed["up"], *packed["down"], i0, i1))
            self.deq.append(deq)
            self.geoms.append((gu, dn))

    def add_to(self, moe, layer_id: int = 0, shards: list | None = None) -> None:
        moe.add_layer(layer_id, shards=shards or self.shards, n_experts=self.E, hidden=self.H,
                      intermediate_pad=self.plan.intermediate_pad, bits=self.bits, group_size=self.G)

    def reference(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, quantized: bool = True) -> np.ndarray:
        """numpy: dequantized weights (ktlayouts) and, if quantized, the README's activation quantization
        (int8 per token per group for x and for h, or bf16 rounding for the bf16 layout)."""
        out = np.zeros((x.shape[0], self.H), np.float64)
        for (gu, dn), deq in zip(self.geoms, self.deq):
            xa = self._act(x.astype(np.float32), gu) if quantized else x.astype(np.float64)
            for e in np.unique(ids[ids >= 0]):
                t, j = np.nonzero(ids == e)
                g, u = xa[t] @ deq["gate"][e].T, xa[t] @ deq["up"][e].T
                h = (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
                ha = self._act(h, dn) if quantized else h.astype(np.float64)
                np.add.at(out, t, weights[t, j, None] * (ha @ deq["down"][e].T))
        return out.astype(np.float32)

    def _act(self, v: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
        if self.bits == 16:
            return bf16_bits_to_f32(f32_to_bf16_bits(v)).astype(np.float64)
        q, s = quantize_activations(v, geom)
        deq = q.reshape(len(v), geom.n_groups, geom.group).astype(np.float64) * s[..., None]
        return deq.reshape(len(v), geom.k_pad)[:, : geom.k]


def routing(rng: np.random.Generator, T: int, k: int, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Random ids (repeats allowed, unsorted) and positive weights."""
    ids = rng.integers(0, n_experts, size=(T, k)).astype(np.int64)
    return ids, rng.random((T, k)).astype(np.float32) + 0.1


def assert_close(got: np.ndarray, ref: np.ndarray, rel: float, what: str) -> None:
    err = np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= rel, f"{what}: max error {err:.3g} of max |ref| (allowed {rel})"
