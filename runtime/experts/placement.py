"""Which routed experts go to the GPU: a budget of hot experts spread over the MoE layers by a strategy, from a
measured activation profile (ktlayouts.expert_profile). Torch-free: `ktconvert quantize --profile` writes the
result into a conversion, ktrun computes it at load (`--profile P --gpu-experts N`).

Budget (in experts, "cells" = (layer, expert) pairs): `--gpu-experts N` per MoE layer, `--gpu-experts-ratio R` of
all routed experts, or `--gpu-mem SIZE` (what fits after the dense layers and a KV budget: fit_hot_experts).

Strategies (every one ranks a layer's experts by the profile's counts, fit + held-out splits):
  uniform    the same number of experts in every layer (a remainder goes to the layers whose next expert is
             called most)
  frequency  the globally most-called cells, whatever their layer
  per-layer  the budget spread by marginal hit gain per byte, where the gain of a layer's n-th expert is measured
             on data that did not rank it: experts ranked on the profile's fit split, their share of calls measured
             on its held-out split, then a greedy walk over each layer's concave hull. Layers whose skew is real
             (it holds on unseen text) get more; layers whose counts are noise stay near uniform.
             Bytes per expert are the same in every MoE layer of the supported families, so per byte = per cell
             here; the hull walk takes per-layer bytes for when they are not.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from ktlayouts.expert_placement import DEFAULT_STRATEGY, STRATEGIES, ExpertPlacement
from ktlayouts.expert_profile import ExpertProfile, ranking

from ..defaults import DYNAMIC_WINDOW_TOKENS


class PlacementError(ValueError):
    """A hot-expert budget or strategy ktrun cannot apply; the message names the flag."""


@dataclass(frozen=True)
class Budget:
    """How many hot experts: exactly one of per_layer, ratio, gpu_mem (bytes); kv_mem: the KV budget for gpu_mem."""
    per_layer: int | None = None
    ratio: float | None = None
    gpu_mem: int | None = None
    kv_mem: int | None = None

    def __post_init__(self):
        given = [x is not None for x in (self.per_layer, self.ratio, self.gpu_mem)]
        if sum(given) > 1:
            raise PlacementError("give one of --gpu-experts, --gpu-experts-ratio and --gpu-mem")
        if self.per_layer is not None and self.per_layer < 0:
            raise PlacementError(f"--gpu-experts must be >= 0, got {self.per_layer}")
        if self.ratio is not None and not 0 <= self.ratio <= 1:
            raise PlacementError(f"--gpu-experts-ratio must be in [0, 1], got {self.ratio}")

    @property
    def given(self) -> bool:
        return self.per_layer is not None or self.ratio is not None or self.gpu_mem is not None

    def cells(self, n_experts: int, n_layers: int, fit_cells: int | None = None) -> int:
        """Total hot experts; fit_cells: how many the memory plan fits (needed for gpu_mem)."""
        if self.per_layer is not None:
            return min(self.per_layer, n_experts) * n_layers
        if self.ratio is not None:
            return round(self.ratio * n_experts * n_layers)
        if self.gpu_mem is not None:
            if fit_cells is None:
                raise PlacementError("--gpu-mem needs the memory plan (dense bytes, KV budget, bytes per expert)")
            return min(fit_cells, n_experts * n_layers)
        return 0

    def to_json(self) -> dict:
        return {k: v for k, v in (("gpu_experts", self.per_layer), ("ratio", self.ratio), ("gpu_mem", self.gpu_mem),
                                  ("kv_mem", self.kv_mem)) if v is not None}


@dataclass(frozen=True)
class HotExpertOptions:
    profile: str | None = None          # profile.json (ktconvert profile)
    budget: Budget = field(default_factory=Budget)
    strategy: str = DEFAULT_STRATEGY    # uniform | frequency | per-layer
    gpu_format: str = "auto"            # auto | marlin | bf16
    dynamic: bool = False
    window: int = DYNAMIC_WINDOW_TOKENS  # dynamic: tokens in the frequency window
    hysteresis: float = 0.25            # dynamic: a newcomer must beat the coldest resident by this factor ...
    min_gap: float = 2.0                # ... plus this many calls
    spare_slots: int = 1                # dynamic: slots per layer beyond the hot experts, for copies in flight
    asynchronous: bool = True           # dynamic: copies on a background thread (False: at the step boundary)


def _split_counts(profile: ExpertProfile, split: str) -> dict[int, np.ndarray]:
    return {L: np.asarray(c, dtype=np.float64) for L, c in profile.counts(split).items()}


def allocate(profile: ExpertProfile | None, n_experts: int, moe_layers, cells: int, strategy: str,
             expert_bytes: dict[int, int] | None = None) -> dict[int, int]:
    """Hot experts per layer (layer -> n) for a total of `cells`. Without a profile only uniform is possible."""
    layers = list(moe_layers)
    cells = max(0, min(int(cells), n_experts * len(layers)))
    if strategy not in STRATEGIES:
        raise PlacementError(f"--placement {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if profile is None or profile.tokens() == 0:
        if strategy != "uniform" and cells:
            raise PlacementError(f"--placement {strategy} needs an activation profile (--profile P)")
        return _uniform(layers, n_experts, cells, None)
    allc = _split_counts(profile, "all")
    if strategy == "uniform":
        return _uniform(layers, n_experts, cells, allc)
    if strategy == "frequency":
        flat = [(-allc[L][e], i, e) for i, L in enumerate(layers) for e in range(n_experts)]
        flat.sort()
        n = dict.fromkeys(layers, 0)
        for _c, i, _e in flat[:cells]:
            n[layers[i]] += 1
        return n
    return _per_layer(profile, layers, n_experts, cells, expert_bytes or dict.fromkeys(layers, 1))


def _uniform(layers, n_experts, cells, allc) -> dict[int, int]:
    base, extra = divmod(cells, len(layers)) if layers else (0, 0)
    n = {L: min(base, n_experts) for L in layers}
    if extra:
        # the remainder goes to the layers whose next expert is called most (first layers without a profile)
        def next_count(L):
            return 0.0 if allc is None else float(np.sort(allc[L])[::-1][n[L]]) if n[L] < n_experts else -1.0
        for L in sorted(layers, key=lambda L: (-next_count(L), layers.index(L)))[:extra]:
            n[L] += 1
    return n


def validated_curve(profile: ExpertProfile, layer: int) -> np.ndarray:
    """(E + 1,) share of calls covered by the top n experts (n = 0..E), measured on data that did not rank them:
    ranked on the fit split, counted on the held-out split. Without held-out data, the fit split alone."""
    fit, held = (np.asarray(profile.counts(s)[layer], dtype=np.float64) for s in ("fit", "heldout"))
    measure = held if held.sum() > 0 and fit.sum() > 0 else fit + held
    return np.concatenate([[0.0], np.cumsum(measure[ranking(fit if fit.sum() > 0 else held)])]) / max(measure.sum(), 1.0)


def _hull_steps(curve: np.ndarray) -> list[tuple[float, int]]:
    """The upper concave hull of a coverage curve as (gain per expert, experts in the step), gains decreasing."""
    pts = [(0, float(curve[0]))]
    for n in range(1, len(curve)):
        pts.append((n, float(curve[n])))
        while len(pts) >= 3:
            (x0, y0), (x1, y1), (x2, y2) = pts[-3:]
            if (y1 - y0) * (x2 - x1) <= (y2 - y1) * (x1 - x0):   # middle point under the chord: not on the hull
                pts.pop(-2)
            else:
                break
    return [((y1 - y0) / (x1 - x0), x1 - x0) for (x0, y0), (x1, y1) in itertools.pairwise(pts)]


def _per_layer(profile, layers, n_experts, cells, expert_bytes) -> dict[int, int]:
    steps = {L: _hull_steps(validated_curve(profile, L)) for L in layers}
    pos = dict.fromkeys(layers, 0)         # next hull step of each layer
    used = dict.fromkeys(layers, 0)        # experts taken inside that step
    n = dict.fromkeys(layers, 0)
    for _ in range(cells):
        best, best_gain = None, -1.0
        for i, L in enumerate(layers):
            if pos[L] < len(steps[L]):
                gain = steps[L][pos[L]][0] / expert_bytes[L]
                if gain > best_gain + 1e-15:
                    best, best_gain = L, gain
        if best is None:
            break
        n[best] += 1
        used[best] += 1
        if used[best] == steps[best][pos[best]][1]:
            pos[best], used[best] = pos[best] + 1, 0
    return n


def choose_experts(profile: ExpertProfile | None, per_layer: dict[int, int]) -> dict[int, tuple[int, ...]]:
    """Each layer's n most-called experts (fit + held-out counts; without a profile the lowest ids)."""
    out = {}
    for L, n in per_layer.items():
        order = ranking(profile.counts("all")[L]) if profile is not None and profile.tokens() else np.arange(n)
        out[L] = tuple(sorted(int(e) for e in order[:n]))
    return out


def plan_placement(profile: ExpertProfile | None, n_experts: int, moe_layers, budget: Budget, strategy: str,
                   gpu_format: str = "auto", fit_cells: int | None = None, profile_sha256: str | None = None,
                   plan: dict | None = None) -> ExpertPlacement:
    """The placement for a budget: cells from the budget (and the memory plan), spread by the strategy."""
    layers = tuple(moe_layers)
    cells = budget.cells(n_experts, len(layers), fit_cells)
    if budget.per_layer is not None and strategy == "uniform":
        per_layer = {L: min(budget.per_layer, n_experts) for L in layers}
    else:
        per_layer = allocate(profile, n_experts, layers, cells, strategy)
    prof = {} if profile is None else {"tokens": profile.tokens(), "source": profile.text.get("source", ""),
                                       **({"sha256": profile_sha256} if profile_sha256 else {})}
    return ExpertPlacement(choose_experts(profile, per_layer), strategy, gpu_format,
                           {**budget.to_json(), **({"plan": plan} if plan else {})}, prof)


def hit_ratio(counts: dict[int, np.ndarray], placement: dict[int, tuple[int, ...]]) -> float:
    """Share of the routed calls in `counts` (layer -> (E,)) that the placement serves on the GPU."""
    hits = sum(float(np.asarray(c)[list(placement.get(L, ()))].sum()) for L, c in counts.items())
    total = sum(float(np.asarray(c).sum()) for c in counts.values())
    return hits / total if total else 0.0
