"""TieredExperts: the routed-expert executor over a RAM tier (ktrun.expert_tier): the CPU kernels read the tier's
mirrors, and each layer's experts are made resident before its kernels start. Same interface as the other
executors (submit / sync / stats / close); ktrun.hybrid_experts wraps it like any CPU executor (its skip mask
leaves GPU-resident experts out of the reads too).

    submit(layer, x, ids, w, out): pin the layer's routed experts and start reading the missing ones; predict the
        next MoE layer's experts (NextLayerPredictor) and start reading those; then launch the kernels, at once
        when everything was resident, else from a launcher thread once the reads land (the model computes the
        shared experts meanwhile)
    sync(): waits for the kernels, unpins the layer's experts

The kernels run once per layer on the complete expert set (not in pieces as experts arrive): a layer split over
two kernel calls would sum its experts in another order, and the tier's promise is the all-in-RAM run's bits.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


class NextLayerPredictor:
    """The next MoE layer's experts from the current layer's MoE input through the next layer's router (its
    weights are dense tensors, already in memory). Scores as the router ranks them: sigmoid + e_score_correction
    bias where the layer has one, else the logits (softmax keeps their order); group limits are ignored. Per
    token the top `top_k + extra` experts; the union over the tokens. Precision/recall against the routing that
    then happens are counted in `stats`."""

    def __init__(self, converted, extra: int = 0):
        cfg, dense = converted.config, converted.dense
        self.top_k, self.extra, self.n_experts = cfg.top_k, extra, cfg.num_experts
        layers = list(cfg.moe_layers)
        self.next = dict(itertools.pairwise(layers))
        self.routers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for L in layers[1:]:
            for name, w in dense.items():
                if name.startswith(f"model.layers.{L}.") and name.endswith(".gate.weight") and w.dim() == 2 \
                        and w.shape[0] == cfg.num_experts:
                    bias = dense.get(name[: -len("weight")] + "e_score_correction_bias")
                    self.routers[L] = (w.float().cpu(), None if bias is None else bias.float().cpu())
                    break
        self._pending: dict[int, set[int]] = {}
        self.stats = {"predicted": 0, "actual": 0, "correct": 0}

    @torch.inference_mode()
    def predict(self, layer: int, x: torch.Tensor) -> tuple[int | None, list[int]]:
        """-> (next MoE layer or None, its predicted experts, best score first)."""
        nxt = self.next.get(layer)
        if nxt is None or nxt not in self.routers:
            return None, []
        w, bias = self.routers[nxt]
        scores = x.detach().float().cpu() @ w.t()                              # (T, E)
        if bias is not None:
            scores = scores.sigmoid() + bias
        k = min(self.n_experts, self.top_k + self.extra)
        top = torch.topk(scores, k, dim=-1)                                    # (T, k) each, best first
        best: dict[int, float] = {}                                            # expert -> its best score
        for e, v in zip(top[1].flatten().tolist(), top[0].flatten().tolist()):
            best[e] = max(v, best.get(e, v))
        pred = sorted(best, key=best.__getitem__, reverse=True)
        self._pending[nxt] = set(pred)
        return nxt, pred

    def observe(self, layer: int, actual: set[int]) -> None:
        pred = self._pending.pop(layer, None)
        if pred is None:
            return
        self.stats["predicted"] += len(pred)
        self.stats["actual"] += len(actual)
        self.stats["correct"] += len(pred & actual)

    @property
    def precision(self) -> float:
        return self.stats["correct"] / self.stats["predicted"] if self.stats["predicted"] else 0.0

    @property
    def recall(self) -> float:
        return self.stats["correct"] / self.stats["actual"] if self.stats["actual"] else 0.0


class TieredExperts:
    def __init__(self, cpu, tier, predictor: NextLayerPredictor | None = None, launch_thread: bool = True):
        """launch_thread=False: a layer whose reads are pending starts its kernels in sync() instead of from the
        launcher thread, for a kernel pool the model's other ops also submit to (the quantized Linears' pool,
        ktrun.loader): a pool takes submissions from one thread at a time."""
        self.cpu, self.tier, self.predictor = cpu, tier, predictor
        self.launch_thread = launch_thread
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="ktrun-tier-launch")
        self._pending = None
        self._lock = threading.Lock()

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
               skip: np.ndarray | None = None):
        if self._pending is not None:
            raise RuntimeError("submit() called twice without sync()")
        ids_np = ids.cpu().numpy()
        need = np.unique(ids_np[ids_np >= 0])
        if skip is not None:
            need = need[skip[need] == 0]                  # GPU-resident experts are neither read nor computed
        if self.predictor is not None:
            self.predictor.observe(layer, {int(e) for e in need})
        gs, futs = self.tier.ensure(layer, need.tolist())
        if self.predictor is not None:                     # read ahead for the next layer while this one runs
            nxt, pred = self.predictor.predict(layer, x)
            if nxt is not None:
                self.tier.prefetch(nxt, pred)
        kw = {} if skip is None else {"skip": skip}
        if not futs:
            self.cpu.submit(layer, x, ids, weights, out, **kw)
            self._pending = (gs, None)
            return

        def launch():
            self.tier.wait(futs)
            self.cpu.submit(layer, x, ids, weights, out, **kw)
        self._pending = (gs, self._launcher.submit(launch) if self.launch_thread else launch)

    def sync(self) -> None:
        if self._pending is None:
            return
        gs, launched = self._pending
        self._pending = None
        try:
            if callable(launched):              # deferred to this thread (launch_thread=False)
                launched()
            elif launched is not None:
                launched.result()
            self.cpu.sync()
        finally:
            self.tier.release(gs)

    @property
    def stats(self) -> dict:
        s = dict(getattr(self.cpu, "stats", {}))
        t = self.tier.stats()
        s.update({f"ram_tier_{k}": v for k, v in t.items()})
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
                          io_threads: int = 4, extra: int = 0, profile_counts=None, n_threads: int | None = None):
    """KernelExperts on the tier's mirrors, wrapped in TieredExperts (with the next-layer predictor if predict)."""
    from .expert_tier import ExpertRamTier
    from .kernel_experts import KernelExperts
    tier = ExpertRamTier(converted, budget_bytes, io=io, io_threads=io_threads, profile_counts=profile_counts)
    cpu = KernelExperts(converted, n_threads=n_threads, layers=tier.mirror_layers)
    shared_pool = cpu.moe is getattr(converted, "kernels", None)
    return TieredExperts(cpu, tier, NextLayerPredictor(converted, extra) if predict else None,
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
    tokens decoded in between): disk bytes per token, disk GB/s while reading, tier and prefetch hit ratios,
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
             f"ram_tier_disk_read_rate: {ratio(d('bytes_read'), d('disk_busy_s')) / 1e9:.3f} GB/s",
             f"ram_tier_demand_wait_per_token: {1e3 * ratio(d('demand_wait_s'), tokens):.3f} ms",
             f"ram_tier_hit_ratio: {ratio(d('ram_hits'), d('demand_experts')):.4f}",
             f"ram_tier_inflight_hit_ratio: {ratio(d('inflight_hits'), d('demand_experts')):.4f}"]
    if "ram_tier_pred_predicted" in after:
        lines += [f"ram_tier_prefetch_hit_ratio: {ratio(d('prefetch_used'), d('prefetch_issued')):.4f}",
                  f"ram_tier_prefetch_throttled_calls: {d('prefetch_throttled')}",
                  f"ram_tier_prediction_precision: {ratio(d('pred_correct'), d('pred_predicted')):.4f}",
                  f"ram_tier_prediction_recall: {ratio(d('pred_correct'), d('pred_actual')):.4f}"]
    return lines
