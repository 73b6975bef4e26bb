"""TieredExperts: the routed-expert executor over a RAM tier (ktrun.experts.ram_tier): the CPU kernels read the tier's
mirrors, and each layer's experts are made resident before its kernels start. Same interface as the other
executors (submit / sync / stats / close); ktrun.experts.hybrid wraps it like any CPU executor (its skip mask
leaves GPU-resident experts out of the reads too).

    submit(layer, x, ids, w, out): pin the layer's routed experts and start reading the missing ones (ascending
        expert order); predict the next MoE layer's experts (ktrun.experts.prediction) and start reading those; then
        launch the kernels: at once when everything was resident, else expert by expert as the reads land (below)
    sync(): waits for the kernels, unpins the layer's experts

Per-expert completion, bit for bit: the kernels add a token's experts into out in ascending expert order, so a layer
computed as several calls over ascending runs of experts, each after the first adding into out (accumulate), gives
the one call's bits (KernelExperts.can_stage: one pool, one shard per layer). The resident experts below the first
missing one are computed at once; each later run starts as soon as its first expert lands, and takes along every
expert after it that is resident or landed by then. Where the kernels cannot stage (several NUMA pools or shards),
the layer runs as one call once all its reads land. The model computes the shared experts meanwhile either way.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .prediction import NextLayerPredictor, make_predictor

__all__ = ["NextLayerPredictor", "TieredExperts", "build_tiered_executor", "find_tier", "tier_lines"]


class TieredExperts:
    def __init__(self, cpu, tier, predictor=None, launch_thread: bool = True):
        """launch_thread=False: the runs after the first start in sync() instead of from the launcher thread, for a
        kernel pool the model's other ops also submit to (the quantized Linears' pool, ktrun.loader): a pool takes
        submissions from one thread at a time."""
        self.cpu, self.tier, self.predictor = cpu, tier, predictor
        self.launch_thread = launch_thread
        self.stage = bool(getattr(cpu, "can_stage", False))
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="ktrun-tier-launch")
        self._pending = None
        self._counts = {"staged_layers": 0, "early_experts": 0}

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
               skip: np.ndarray | None = None):
        if self._pending is not None:
            raise RuntimeError("submit() called twice without sync()")
        ids_np = ids.cpu().numpy()
        need = np.unique(ids_np[ids_np >= 0])               # ascending: the kernels' summation order
        if skip is not None:
            need = need[skip[need] == 0]                  # GPU-resident experts are neither read nor computed
        if self.predictor is not None:
            self.predictor.observe(layer, {int(e) for e in need}, ids_np)
        gs, each = self.tier.ensure_each(layer, need.tolist())
        self._launch(layer, x, ids, weights, out, skip, need, gs, each)
        if self.predictor is not None:     # read ahead for the next layer while this one runs (after the kernels
            limit = self.tier.prefetch_gate()          # start: its reads queue behind this layer's); no prediction
            if limit != 0:                             # (~0.3 ms of CPU per layer) while the tier would read none
                nxt, pred = self.predictor.predict(layer, x, ids_np)
                if nxt is not None:
                    self.tier.prefetch(nxt, pred, limit=limit)

    def _launch(self, layer, x, ids, weights, out, skip, need, gs, each) -> None:
        """Start the kernels on the layer: at once when everything is resident, else run by run as reads land."""
        kw = {} if skip is None else {"skip": skip}
        missing = [i for i, f in enumerate(each) if f is not None]
        if not missing:
            self.cpu.submit(layer, x, ids, weights, out, **kw)
            self._pending = (gs, None)
            return
        if not self.stage:
            def launch():
                self.tier.wait(each)
                self.cpu.submit(layer, x, ids, weights, out, **kw)
            self._pending = (gs, self._launcher.submit(launch) if self.launch_thread else launch)
            return
        E = self.tier.n_experts

        def only(run) -> np.ndarray:                       # skip mask leaving in exactly the experts of `run`
            m = np.ones(E, dtype=np.uint8)
            m[run] = 0
            return m
        self._counts["staged_layers"] += 1
        first = missing[0]
        started = first > 0
        if started:                                        # resident experts below the first missing one: now
            self.cpu.submit(layer, x, ids, weights, out, skip=only(need[:first]))
            self._counts["early_experts"] += first

        def rest():
            i, begun = first, started
            while i < len(need):
                self.tier.wait([each[i]])
                j = i + 1
                while j < len(need) and (each[j] is None or each[j].done()):
                    j += 1
                self.tier.wait(each[i + 1:j])              # landed: raises a read error, waits for nothing
                if begun:
                    self.cpu.submit_more(only(need[i:j]))
                else:
                    self.cpu.submit(layer, x, ids, weights, out, skip=only(need[i:j]))
                    begun = True
                i = j
        self._pending = (gs, self._launcher.submit(rest) if self.launch_thread else rest)

    def sync(self) -> None:
        if self._pending is None:
            return
        gs, launched = self._pending
        self._pending = None
        try:
            try:
                if callable(launched):          # deferred to this thread (launch_thread=False)
                    launched()
                elif launched is not None:
                    launched.result()
            finally:
                self.cpu.sync()                 # the runs already submitted, also when a read failed
        finally:
            self.tier.release(gs)

    @property
    def stats(self) -> dict:
        s = dict(getattr(self.cpu, "stats", {}))
        t = self.tier.stats()
        s.update({f"ram_tier_{k}": v for k, v in t.items()})
        s.update({f"ram_tier_{k}": v for k, v in self._counts.items()})
        if self.predictor is not None:
            s.update({f"ram_tier_pred_{k}": v for k, v in self.predictor.stats.items()})
            s["ram_tier_prediction_precision"] = self.predictor.precision
            s["ram_tier_prediction_recall"] = self.predictor.recall
        return s              # cheap: the Engine merges it every step (mincore is tier.measured_resident_bytes())

    def close(self) -> None:
        self._launcher.shutdown(wait=True)
        close = getattr(self.cpu, "close", None)
        if close:
            close()
        self.tier.close()


def build_tiered_executor(converted, budget_bytes: int, predict: bool = True, io: str = "direct",
                          io_threads: int = 4, extra: int = 0, profile_counts=None, n_threads: int | None = None,
                          predictor: str = "router"):
    """KernelExperts on the tier's mirrors, wrapped in TieredExperts (with `predictor`, ktrun.experts.prediction,
    if predict)."""
    from .kernel import KernelExperts
    from .ram_tier import ExpertRamTier
    tier = ExpertRamTier(converted, budget_bytes, io=io, io_threads=io_threads, profile_counts=profile_counts)
    cpu = KernelExperts(converted, n_threads=n_threads, layers=tier.mirror_layers)
    shared_pool = cpu.moe is getattr(converted, "kernels", None)
    return TieredExperts(cpu, tier, make_predictor(predictor, converted, extra) if predict else None,
                         launch_thread=not shared_pool)


def find_tier(executor):
    """The ExpertRamTier under an executor (TieredExperts itself, or the CPU side of HybridExperts), or None."""
    while executor is not None:
        if isinstance(executor, TieredExperts):
            return executor.tier
        executor = getattr(executor, "cpu", None)
    return None


def tier_lines(before: dict, after: dict, tokens: int, measured: int | None = None) -> list[str]:
    """`name: value unit` lines of the RAM tier over the steps between two executor `stats` snapshots (the
    tokens decoded in between): disk bytes per token (all; needed: demand reads + prefetches then used; prefetched),
    disk GB/s while reading, tier and prefetch hit ratios,
    prediction precision/recall, resident bytes against the budget (measured: the tier's mincore count)."""
    if "ram_tier_budget_bytes" not in after:
        return []

    def d(key):
        return after.get(f"ram_tier_{key}", 0) - before.get(f"ram_tier_{key}", 0)

    def ratio(a, b):
        return a / b if b else 0.0

    lines = [f"ram_tier_io: {after['ram_tier_io']}",
             f"ram_tier_budget: {after['ram_tier_budget_bytes']} bytes",
             f"ram_tier_peak_resident: {after['ram_tier_peak_resident_bytes']} bytes",
             *([f"ram_tier_measured_resident: {measured} bytes"] if measured is not None else []),
             f"ram_tier_disk_bytes_per_token: {ratio(d('bytes_read'), tokens):.0f} bytes",
             f"ram_tier_needed_bytes_per_token: {ratio(d('bytes_demand') + d('bytes_prefetch_used'), tokens):.0f} bytes",
             f"ram_tier_prefetch_bytes_per_token: {ratio(d('bytes_prefetch'), tokens):.0f} bytes",
             f"ram_tier_disk_read_rate: {ratio(d('bytes_read'), d('disk_busy_s')) / 1e9:.3f} GB/s",
             f"ram_tier_demand_wait_per_token: {1e3 * ratio(d('demand_wait_s'), tokens):.3f} ms",
             f"ram_tier_hit_ratio: {ratio(d('ram_hits'), d('demand_experts')):.4f}",
             f"ram_tier_inflight_hit_ratio: {ratio(d('inflight_hits'), d('demand_experts')):.4f}",
             f"ram_tier_layers_computed_while_reading_per_token: {ratio(d('staged_layers'), tokens):.2f}",
             f"ram_tier_experts_computed_before_reads_per_token: {ratio(d('early_experts'), tokens):.2f}"]
    if "ram_tier_pred_predicted" in after:
        lines += [f"ram_tier_prefetch_hit_ratio: {ratio(d('prefetch_used'), d('prefetch_issued')):.4f}",
                  f"ram_tier_prefetch_throttled_calls: {d('prefetch_throttled')}",
                  f"ram_tier_prefetch_cancelled: {d('prefetch_cancelled')}",
                  f"ram_tier_prediction_precision: {ratio(d('pred_correct'), d('pred_predicted')):.4f}",
                  f"ram_tier_prediction_recall: {ratio(d('pred_correct'), d('pred_actual')):.4f}"]
    return lines
