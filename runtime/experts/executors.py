"""Routed-expert executors. One interface, asynchronous so the shared experts run while the routed ones compute:

    ex.submit(layer, x, ids, weights, out)   # x: (T, H); ids, weights: (T, k); out: (T, H) written by sync()
    ... other work (shared experts) ...
    ex.sync()                                # waits; out now holds sum_k weights[t, k] * expert_{ids[t, k]}(x[t])
    ex.submit(layer, x, ids, weights, out, skip=mask)   # mask (E,) uint8: experts computed elsewhere (GPU) left out

- TorchExperts: the reference. Expert matrices come from an ExpertSource (packed tiles dequantized with ktlayouts,
  or plain float tensors), are cached per expert as float32 and applied with torch. Always correct, not fast.
- KernelExperts (kernel.py): the C++ kernels through runtime/ops/moe.py, reading the mapped tiles in place.

Both compute the family's ExpertActivation (ktlayouts.families): silu(g) * u, or gpt-oss's clamped SwiGLU with
per-expert biases (`expert_biases`).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from ktlayouts.cpu_expert import unpack_expert_matrix
from ktlayouts.expert_shards import join_shards
from ktlayouts.families import SILU, ExpertActivation

from ..ops.library import kernels_available
from .activation import Biases, activate, expert_biases


class PackedExpertSource:
    """Experts of every MoE layer as packed tiles: layers[L] = list over shards of {proj: (qweight, scales, geom)}
    with qweight (E, NB, KT, TB) and scales (E, NB, G, 16) or None (bf16) — numpy memmaps of the expert files."""

    def __init__(self, layers: dict[int, list[dict]], intermediate: int):
        self.layers, self.intermediate = layers, intermediate

    def expert(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> gate (I, H), up (I, H), down (H, I) float32 for expert e, shards concatenated along I."""
        per_shard = [{p: unpack_expert_matrix(qw[e], None if sc is None else sc[e], geom)
                      for p, (qw, sc, geom) in shard.items()} for shard in self.layers[layer]]
        m = join_shards(per_shard, self.intermediate)
        return m["gate"], m["up"], m["down"]


class DenseExpertSource:
    """Experts as float tensors: layers[L] = (gate (E, I, H), up (E, I, H), down (E, H, I))."""

    def __init__(self, layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        self.layers = layers

    def expert(self, layer: int, e: int):
        g, u, d = self.layers[layer]
        return g[e], u[e], d[e]


class TorchExperts:
    """Reference executor: dequantized float32 experts (cached on first use), torch matmuls, one worker thread."""

    def __init__(self, source, device="cpu", asynchronous: bool = True, cache: bool = True,
                 activation: ExpertActivation = SILU, biases: Biases | None = None):
        """cache=False: read each expert from the source on every use (memory stays at one expert; profiling a
        checkpoint that does not fit in RAM as float32). activation / biases: the family's (expert_biases)."""
        self.source, self.device, self.cache = source, torch.device(device), cache
        self.activation = activation
        self.biases = {L: tuple(torch.from_numpy(b).to(self.device) for b in bs) for L, bs in (biases or {}).items()}
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ktrun-experts") if asynchronous else None
        self._pending: Future | None = None
        self.stats = {"expert_compute_s": 0.0, "expert_calls": 0, "expert_token_slots": 0}

    def _weights(self, layer: int, e: int):
        key = (layer, e)
        with self._lock:
            w = self._cache.get(key)
        if w is None:
            w = tuple(torch.as_tensor(np.asarray(m, dtype=np.float32) if not torch.is_tensor(m) else m)
                      .to(self.device, torch.float32) for m in self.source.expert(layer, e))
            if self.cache:
                with self._lock:
                    self._cache[key] = w
        return w

    @torch.inference_mode()
    def _run(self, layer, x, ids, weights, out):
        t0 = time.perf_counter()
        dev = self.device                       # experts live here; activations may come from a GPU
        acc = torch.zeros(out.shape, dtype=torch.float32, device=dev)
        xf, ids, weights = x.float().to(dev), ids.to(dev), weights.to(dev)
        for e in torch.unique(ids).tolist():
            if e < 0:                               # skipped (computed elsewhere)
                continue
            tok, kpos = torch.where(ids == e)
            g, u, d = self._weights(layer, e)
            bg, bu, bd = (b[e] for b in self.biases[layer]) if layer in self.biases else (None, None, None)
            xe = xf[tok]
            y = F.linear(activate(self.activation, F.linear(xe, g, bg), F.linear(xe, u, bu)), d, bd)
            acc.index_add_(0, tok, y * weights[tok, kpos, None].float())
        out.copy_(acc.to(device=out.device, dtype=out.dtype))
        self.stats["expert_compute_s"] += time.perf_counter() - t0
        self.stats["expert_calls"] += 1
        self.stats["expert_token_slots"] += ids.numel()

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
               skip: np.ndarray | None = None):
        if self._pending is not None:
            raise RuntimeError("submit() called twice without sync()")
        if skip is not None:                        # as the kernels: masked experts count as ids < 0
            ids = torch.where(torch.from_numpy(skip.astype(bool))[ids.cpu()].to(ids.device), -1, ids)
        if self._pool is None:
            self._run(layer, x, ids, weights, out)
        else:
            self._pending = self._pool.submit(self._run, layer, x, ids, weights, out)

    def sync(self) -> None:
        if self._pending is not None:
            fut, self._pending = self._pending, None
            fut.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def make_executor(converted, use_kernels: bool | None = None):
    """The kernel executor when available (use_kernels None = auto, True = required), else the torch reference."""
    if use_kernels is None:
        use_kernels = kernels_available()
    if use_kernels:
        from .kernel import KernelExperts
        return KernelExperts(converted)
    return TorchExperts(PackedExpertSource(converted.experts, converted.geometry.intermediate), device="cpu",
                        activation=converted.config.expert_activation, biases=expert_biases(converted))
