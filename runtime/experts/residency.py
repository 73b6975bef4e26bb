"""Where each (MoE layer, routed expert) runs: the one place that decides it.

Per MoE layer:
  skip (E,) uint8   1 = resident on the GPU: handed as is to the CPU kernels' mask (kt_submit_masked), which leave
                    those experts out; 0 = computed by the CPU kernels
  slot (E,) int32   the GPU slot holding a resident expert's weights (ktrun.experts.hot_store), -1 elsewhere
  free              slots holding no resident expert (a swap copies into one of them first)

Changes happen only between steps (ktrun.experts.hybrid calls them before a forward's first MoE layer), and the
kernels read the mask during submit only, so no step ever sees a half-made change. A future tier (experts streamed
from NVMe) adds its state here.
"""
from __future__ import annotations

import numpy as np


class ExpertResidency:
    def __init__(self, n_experts: int, slots_per_layer: dict[int, int]):
        self.n_experts = n_experts
        self.skip = {L: np.zeros(n_experts, dtype=np.uint8) for L in slots_per_layer}
        self.slot = {L: np.full(n_experts, -1, dtype=np.int32) for L in slots_per_layer}
        self.free = {L: list(range(n)) for L, n in slots_per_layer.items()}

    @property
    def layers(self) -> list[int]:
        return list(self.skip)

    def on_gpu(self, layer: int) -> list[int]:
        return [int(e) for e in np.flatnonzero(self.skip[layer])]

    def where(self, layer: int, e: int) -> str:
        return "gpu" if layer in self.skip and self.skip[layer][e] else "cpu"

    def n_resident(self) -> int:
        return int(sum(int(m.sum()) for m in self.skip.values()))

    def take_free(self, layer: int) -> int | None:
        """Reserve a free slot of `layer` (for a copy in flight); None when there is none."""
        return self.free[layer].pop(0) if self.free.get(layer) else None

    def give_back(self, layer: int, slot: int) -> None:
        self.free[layer].append(slot)

    def place(self, layer: int, e: int, slot: int) -> None:
        """Expert e (its weights now in `slot`, reserved with take_free) runs on the GPU from the next submit on."""
        if self.skip[layer][e]:
            raise RuntimeError(f"layer {layer} expert {e} is already resident (slot {self.slot[layer][e]})")
        self.slot[layer][e] = slot
        self.skip[layer][e] = 1

    def evict(self, layer: int, e: int) -> int:
        """Expert e runs on the CPU from the next submit on; returns its slot, now free."""
        slot = int(self.slot[layer][e])
        if not self.skip[layer][e] or slot < 0:
            raise RuntimeError(f"layer {layer} expert {e} is not resident")
        self.skip[layer][e] = 0
        self.slot[layer][e] = -1
        self.free[layer].append(slot)
        return slot

    def snapshot(self) -> dict[int, tuple[int, ...]]:
        """layer -> the resident experts (for logs, replays and tests)."""
        return {L: tuple(self.on_gpu(L)) for L in self.skip}
