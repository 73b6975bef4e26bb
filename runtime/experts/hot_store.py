"""Hot experts' weights on the GPU (or, without CUDA, on the CPU through torch), in slots, and their computation.

A slot of MoE layer L holds one expert's gate, up and down in a GPU format:
  marlin  the CPU tiles' own codes regrouped by ktlayouts.expert_gpu (exact) and packed by the format registry
          (ktlayouts.gpu_formats 'marlin', float16 scales): ktrun.ops.packed_linear.MarlinLinear, run by an installed
          Marlin GEMM (else dequantized per call, as every packed Linear).
  gptq    the same codes and scales in the GPTQ layout (qweight and scales only): ktrun.ops.triton_linear.TritonLinear,
          run by ktrun's own Triton kernel (CUDA with torch alone; CPU tensors under TRITON_INTERPRET=1).
  bf16    the dequantized expert (exactly the CPU tiles' values) rounded to bf16; computed in the dense dtype (on
          the CPU stand-in the rounded values are kept in that dtype, so no call converts them).
Slot tensors are allocated once; loading an expert copies into them (`pack` on the host, `upload` to the slot), so
a swap needs no allocation and never touches a slot that a step reads (ktrun.experts.residency says which).

Families whose experts carry biases and another activation (gpt-oss: gate/up/down biases and the clamped SwiGLU,
ktlayouts.families.ExpertActivation) get the slot's biases too, float32 beside the weights in either format (packed
and copied with them, so a dynamic swap moves them together), and compute the family's activation
(ktrun.experts.activation.activate, the formula the CPU executors run).

Accuracy against the CPU kernels (which quantize activations to int8 per group): both compute the same dequantized
weights; bf16 rounds each weight by at most 2^-9 relative, Marlin rounds each scale to float16 (2^-11; an
installed kernel then casts scales to the activation dtype, bf16: 2^-9). Either is well inside the kernels' own
activation-quantization error, which is the bound the tests hold the hybrid run to.
"""
from __future__ import annotations

import numpy as np
import torch
from ktlayouts.converted_dir import PROJECTIONS, ExpertGeometry
from ktlayouts.cpu_expert import LayoutError
from ktlayouts.expert_gpu import expert_codes, gpu_group_step, hot_expert_nbytes, hot_format_ok, source_shape
from ktlayouts.gpu_formats import gpu_format_for

from ..ops.marlin import find_marlin_kernel
from ..ops.packed_linear import MarlinLinear, linear
from ..ops.triton_linear import TritonLinear, use_triton
from .activation import activate, expert_biases
from .executors import PackedExpertSource


class HotExpertError(ValueError):
    """Hot experts that cannot be held in the requested GPU format; the message names the flag."""


def resolve_format(geo: ExpertGeometry, requested: str, device: torch.device) -> str:
    """'auto' -> the packed format whose kernel runs on this device (gptq when ktrun's Triton kernel is chosen,
    ktrun.ops.triton_linear.use_triton; else marlin when a Marlin GEMM is installed) if it holds the codes exactly,
    else bf16."""
    device = torch.device(device)
    marlin_found = find_marlin_kernel(device) is not None
    if requested == "auto":
        if use_triton(device, marlin_found) and hot_format_ok(geo, "gptq") is None:
            return "gptq"
        return "marlin" if marlin_found and hot_format_ok(geo, "marlin") is None else "bf16"
    why = hot_format_ok(geo, requested)
    if why is None and requested == "gptq" and not use_triton(device, marlin_found=False):
        why = f"ktrun's Triton kernel does not run on {device} (CUDA, or the CPU with TRITON_INTERPRET=1 KTRUN_TRITON=on)"
    if why:
        raise HotExpertError(f"--gpu-expert-format {requested}: {why}")
    return requested


class HotExpertStore:
    """slots[L]: per slot (gate, up, down) on `device`; load(L, slot, e) fills one; compute(...) runs them."""

    def __init__(self, converted, slots_per_layer: dict[int, int], fmt: str = "auto", device=None, dtype=None):
        self.geo: ExpertGeometry = converted.geometry
        self.device = torch.device(device or converted.device)
        self.dtype = dtype or converted.dtype
        self.format = resolve_format(self.geo, fmt, self.device)
        self._experts = converted.experts                    # layer -> shards -> {proj: (qweight, scales, geom)}
        self._dense = PackedExpertSource(converted.experts, self.geo.intermediate)
        self.activation = converted.config.expert_activation
        self._biases = expert_biases(converted)             # layer -> (gate (E, I), up (E, I), down (E, H)); {}: none
        self.expert_nbytes = hot_expert_nbytes(self.geo, self.format, self.activation.bias)  # as a GPU holds them
        # bf16 weights stored as bf16 on a GPU; on the CPU stand-in, bf16-rounded values in the (wider) dense dtype
        self._bf16_storage = torch.bfloat16 if self.device.type == "cuda" else self.dtype
        if self.format != "bf16":
            self._fmt = gpu_format_for(self.format, self.geo.bits)
            self._step = gpu_group_step(self.geo)
            self._kernel = find_marlin_kernel(self.device)
        self.slots = {L: [self._empty_slot() for _ in range(n)] for L, n in slots_per_layer.items()}
        # per slot (gate (I,), up (I,), down (H,)) float32 biases, for families with expert biases
        self.bias_slots = {L: [tuple(torch.zeros(source_shape(self.geo, p)[0], dtype=torch.float32, device=self.device)
                                     for p in PROJECTIONS) for _ in range(n)]
                           for L, n in slots_per_layer.items()} if self.activation.bias else None

    @property
    def nbytes(self) -> int:
        return self.expert_nbytes * sum(len(s) for s in self.slots.values())

    # --- storage ----------------------------------------------------------------------------------------------
    def _empty_slot(self) -> tuple:
        out = []
        for p in PROJECTIONS:
            n, k = source_shape(self.geo, p)
            if self.format == "bf16":
                out.append(torch.zeros((n, k), dtype=self._bf16_storage, device=self.device))
                continue
            shapes = {s: shape for s, _dt, shape in self._fmt.part_shapes(self._fmt.storage_geometry(n, k, self._step))}
            qw = torch.zeros(shapes["qweight"], dtype=torch.int32, device=self.device)
            sc = torch.zeros(shapes["scales"], dtype=torch.float16, device=self.device)
            if self.format == "gptq":
                out.append(TritonLinear(f"hot expert {p}", qw, sc, None, self.geo.bits, self._step, n, k, self.dtype))
                continue
            use = self._kernel if self._kernel is not None and self._kernel.supports(
                self.geo.bits, self._step, self.dtype) else None
            out.append(MarlinLinear(f"hot expert {p}", qw, sc, self.geo.bits, n, k, self.dtype, kernel=use))
        return tuple(out)

    def pack(self, layer: int, e: int) -> list[dict[str, np.ndarray]]:
        """Host arrays of expert e of `layer` in the slot format, per projection (gate, up, down), with its bias
        ("bias", float32) where the family has them. Pure numpy: the background copy thread of the dynamic placement
        runs it while decode steps go on."""
        out = self._pack_weights(layer, e)
        if self.bias_slots is not None:
            for parts, b in zip(out, self._biases[layer]):
                parts["bias"] = np.ascontiguousarray(b[e], dtype=np.float32)
        return out

    def _pack_weights(self, layer: int, e: int) -> list[dict[str, np.ndarray]]:
        if self.format == "bf16":
            mats = self._dense.expert(layer, e)                                  # gate (I, H), up, down (H, I) f32
            return [{"weight": np.ascontiguousarray(m, dtype=np.float32)} for m in mats]
        out = []
        for p in PROJECTIONS:
            n, k = source_shape(self.geo, p)
            shards = [(shard[p][0][e], shard[p][1][e]) for shard in self._experts[layer]]
            codes, scales = expert_codes(self.geo, p, self._step, shards)       # (N, K), (N, K / step)
            geom = self._fmt.storage_geometry(n, k, self._step)
            codes_kn = np.full((geom.k, geom.n), 1 << (self.geo.bits - 1), dtype=np.uint8)   # pad: weight 0
            codes_kn[:k, :n] = codes.T
            scales_gn = np.zeros(geom.scales_shape, dtype=np.float32)
            scales_gn[: scales.shape[1], :n] = scales.T
            try:
                out.append(self._fmt.pack(codes_kn, scales_gn, geom, shape=(n, k), name=f"layer {layer} expert {e} {p}"))
            except LayoutError as err:
                raise HotExpertError(str(err)) from None
        return out

    def upload(self, layer: int, slot: int, host: list[dict[str, np.ndarray]], non_blocking: bool = False) -> None:
        """Copy packed host arrays into slot `slot` of `layer` (on the current stream)."""
        if self.bias_slots is not None:
            for dst, parts in zip(self.bias_slots[layer][slot], host):
                dst.copy_(torch.from_numpy(parts["bias"]), non_blocking=non_blocking)
        for dst, parts in zip(self.slots[layer][slot], host):
            if self.format == "bf16":
                dst.copy_(torch.from_numpy(parts["weight"]).to(torch.bfloat16).to(dst.dtype), non_blocking=non_blocking)
            else:
                dst.qweight.copy_(torch.from_numpy(parts["qweight"]), non_blocking=non_blocking)
                dst.scales.copy_(torch.from_numpy(parts["scales"]).to(dst.scales.dtype), non_blocking=non_blocking)

    def load(self, layer: int, slot: int, e: int) -> None:
        self.upload(layer, slot, self.pack(layer, e))

    # --- compute ----------------------------------------------------------------------------------------------
    def expert_forward(self, layer: int, slot: int, x: torch.Tensor) -> torch.Tensor:
        """x: (M, H) -> (M, H): down(act(gate x + b_gate, up x + b_up)) + b_down with the slot's weights; act is
        the family's (silu(g) * u without biases for most)."""
        g, u, d = self.slots[layer][slot]
        if self.format == "bf16" and x.dtype != g.dtype:
            g, u, d = (w.to(x.dtype) for w in (g, u, d))       # bf16 weights, computed in the dense dtype
        bg = bu = bd = None
        if self.bias_slots is not None:
            bg, bu, bd = (b.to(x.dtype) for b in self.bias_slots[layer][slot])
        return linear(activate(self.activation, linear(x, g, bg), linear(x, u, bu)), d, bd)

    def compute(self, layer: int, x: torch.Tensor, ids_np: np.ndarray, weights: torch.Tensor, hit: np.ndarray,
                slot_of: np.ndarray) -> torch.Tensor:
        """The GPU-resident part of a layer: sum over the (t, j) with hit[t, j] of weights[t, j] * expert(x[t]).
        x: (T, H) on the device; ids_np, hit: (T, k) on the host; slot_of: (E,) slot of each resident expert.
        -> (T, H) float32 on x's device (launched asynchronously on CUDA)."""
        t_idx, j_idx = np.nonzero(hit)
        experts = ids_np[t_idx, j_idx]
        # rows grouped by expert id (not slot: the sum order must not depend on which slot an expert landed in),
        # token order inside
        order = np.argsort(experts, kind="stable")
        t_idx, j_idx, experts = t_idx[order], j_idx[order], experts[order]
        cuts = np.flatnonzero(np.diff(experts)) + 1
        starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(experts)]])
        dev = x.device
        tok = torch.from_numpy(t_idx).to(dev, non_blocking=True)
        w = weights.to(dev)[tok, torch.from_numpy(j_idx).to(dev, non_blocking=True)].float()
        out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32, device=dev)
        for a, b in zip(starts.tolist(), ends.tolist()):
            rows = tok[a:b]
            y = self.expert_forward(layer, int(slot_of[experts[a]]), x[rows])
            out.index_add_(0, rows, y.float() * w[a:b, None])
        return out
