"""HybridExperts: routed experts split between the GPU (hot experts, ktrun.experts.hot_store) and the CPU executor
(the kernels, or the torch reference), by ktrun.experts.residency. Same interface as the other executors.

    submit(layer, x, ids, w, out): the CPU executor starts on the experts not resident on the GPU (the residency's
        mask goes to the kernels as is: no copy of ids), then the GPU side launches its experts with the same routed
        weights (asynchronous on CUDA), and the model computes the shared experts meanwhile
    sync(): waits for the CPU part, adds the GPU part: out = cpu + gpu

Hooks registered in `before_step` run before each forward's first MoE layer, i.e. between two steps (dynamic
placement flips its swaps there). stats: the CPU executor's, plus routed calls and the GPU hit ratio (share of
routed calls served on the GPU), overall and per layer, resident experts, their bytes and the swaps done.
"""
from __future__ import annotations

import torch


class HybridExperts:
    def __init__(self, cpu, store, residency, dynamic=None, placement=None):
        self.cpu, self.store, self.residency, self.dynamic = cpu, store, residency, dynamic
        self.placement = placement                  # the static ExpertPlacement it started from (None: empty)
        self.first_layer = min(residency.layers)
        self.before_step = [dynamic] if dynamic is not None else []
        self.steps = 0
        self._calls = dict.fromkeys(residency.layers, 0)
        self._hits = dict.fromkeys(residency.layers, 0)
        self._pending: tuple | None = None

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor):
        if self._pending is not None:
            raise RuntimeError("submit() called twice without sync()")
        if layer == self.first_layer:                      # a new forward: between two steps
            self.steps += 1
            for hook in self.before_step:
                hook(self.steps)
        ids_cpu = ids.cpu()
        ids_np = ids_cpu.numpy()
        skip = self.residency.skip[layer]
        hit = skip[ids_np].astype(bool) & (ids_np >= 0)      # (T, k) calls served on the GPU
        n_hit = int(hit.sum())
        self._calls[layer] += int((ids_np >= 0).sum())
        self._hits[layer] += n_hit
        if self.dynamic is not None:
            self.dynamic.observe(layer, ids_np)
        # CPU first (it returns at once), then the GPU part; without hits the CPU call is the plain one
        self.cpu.submit(layer, x, ids_cpu, weights, out, **({"skip": skip} if n_hit else {}))
        gpu = self.store.compute(layer, x, ids_np, weights, hit, self.residency.slot[layer]) if n_hit else None
        self._pending = (out, gpu)

    def sync(self) -> None:
        if self._pending is None:
            return
        out, gpu = self._pending
        self._pending = None
        self.cpu.sync()
        if gpu is not None:
            out.add_(gpu.to(device=out.device, dtype=out.dtype))

    def close(self) -> None:
        if self.dynamic is not None:
            self.dynamic.close()
        close = getattr(self.cpu, "close", None)
        if close:
            close()

    # -- statistics --------------------------------------------------------------------------------------------
    def hit_counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """(GPU-served calls, routed calls) per layer so far."""
        return dict(self._hits), dict(self._calls)

    @property
    def stats(self) -> dict:
        hits, calls = sum(self._hits.values()), sum(self._calls.values())
        s = dict(getattr(self.cpu, "stats", {}))
        s.update({"routed_expert_calls": calls, "gpu_expert_calls": hits,
                  "gpu_hit_ratio": hits / calls if calls else 0.0,
                  "gpu_experts_resident": self.residency.n_resident(), "gpu_expert_bytes": self.store.nbytes,
                  "gpu_expert_format": self.store.format,
                  "expert_swaps": self.dynamic.swaps if self.dynamic is not None else 0,
                  "gpu_hit_ratio_by_layer": {L: self._hits[L] / c if c else 0.0 for L, c in self._calls.items()}})
        return s


def hit_ratio_between(before: tuple[dict, dict], after: tuple[dict, dict], per_layer: bool = False):
    """GPU hit ratio of the calls made between two hit_counts() snapshots (overall, or layer -> ratio)."""
    dh = {L: after[0][L] - before[0].get(L, 0) for L in after[0]}
    dc = {L: after[1][L] - before[1].get(L, 0) for L in after[1]}
    if per_layer:
        return {L: dh[L] / dc[L] if dc[L] else 0.0 for L in dc}
    total = sum(dc.values())
    return sum(dh.values()) / total if total else 0.0
