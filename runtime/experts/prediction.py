"""Which experts the next MoE layer will route to, guessed while this layer runs, so the RAM tier
(ktrun.experts.ram_tier) can start reading them before they are asked for (`--expert-ram-predictor`).

Both predictors have one interface, called by ktrun.experts.tiered for each MoE layer L, in order:

    observe(L, actual, ids)   L's routing is known: `actual` the experts it must compute (a set), `ids` (T, k) its
                              routed ids; scores the prediction made for L against it (precision / recall in stats)
                              and learns from it
    predict(L, x, ids)        -> (L', experts of L' best first): L' the next MoE layer, x (T, H) L's MoE input

  router  the next layer's router on this layer's MoE input (its weights are dense tensors, already in memory): a
          token's hidden state changes little from one layer to the next, so the next router, applied early,
          ranks roughly as it will. The top-k per token is the family's own routing (ktrun.models: group limits,
          correction bias; on the default model's real routing group limits raised precision from 0.63 to 0.71);
          the order, and `extra` experts beyond it, come from the router's scores: sigmoid + e_score_correction
          bias where the layer has one, else the logits (softmax keeps their order).
  coact   co-activation counts, learned online: C[L'][a, b] = how often a token routed to expert a at L was then
          routed to b at L'. A token's score for b is the mean over its experts a at L of C[a, b] / (calls of a);
          before anything is learned for a, the previous token's selection at L' stands in.

Per token the top `top_k + extra` experts (router: its routed top-k plus the `extra` best-scored others); the union
over the tokens, ranked by each expert's best score.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch
from ktlayouts.families import get_family

from ..models import arch_module

PREDICTORS = ("router", "coact")


class _Scored:
    """The bookkeeping both predictors share: the pending prediction per layer and its precision / recall."""

    def __init__(self, converted, extra: int):
        cfg = converted.config
        self.top_k, self.extra, self.n_experts = cfg.top_k, extra, cfg.num_experts
        self.layers = list(cfg.moe_layers)
        self.next = dict(itertools.pairwise(self.layers))
        self.prev = {b: a for a, b in self.next.items()}
        self._pending: dict[int, set[int]] = {}
        self.stats = {"predicted": 0, "actual": 0, "correct": 0}

    def observe(self, layer: int, actual: set[int], ids: np.ndarray | None = None) -> None:
        pred = self._pending.pop(layer, None)
        if pred is not None:
            self.stats["predicted"] += len(pred)
            self.stats["actual"] += len(actual)
            self.stats["correct"] += len(pred & actual)
        if ids is not None:
            self.learn(layer, ids)

    def learn(self, layer: int, ids: np.ndarray) -> None:
        pass

    def _rank(self, nxt: int, scores: np.ndarray, floor: float | None = None, chosen: np.ndarray | None = None
              ) -> list[int]:
        """scores (T, E) -> the union of each token's top (top_k + extra), best score first (scores <= floor, if
        given, are no evidence and left out). chosen (T, k): each token's routed top-k, given where the family's
        routing is not plain top-k of the scores (group limits); `extra` best-scored others are added to it."""
        k = min(self.n_experts, self.top_k + self.extra)
        if chosen is not None:
            rest = scores.copy()
            np.put_along_axis(rest, chosen, -np.inf, axis=1)
            top = np.concatenate([chosen, np.argsort(-rest, axis=1, kind="stable")[:, :self.extra]], axis=1)
        elif k < self.n_experts:
            top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        else:
            top = np.tile(np.arange(self.n_experts), (scores.shape[0], 1))
        best: dict[int, float] = {}
        for t in range(scores.shape[0]):
            for e in top[t].tolist():
                v = float(scores[t, e])
                if floor is None or v > floor:
                    best[e] = max(v, best.get(e, v))
        pred = sorted(best, key=lambda e: (-best[e], e))
        self._pending[nxt] = set(pred)
        return pred

    @property
    def precision(self) -> float:
        return self.stats["correct"] / self.stats["predicted"] if self.stats["predicted"] else 0.0

    @property
    def recall(self) -> float:
        return self.stats["correct"] / self.stats["actual"] if self.stats["actual"] else 0.0


class NextLayerPredictor(_Scored):
    """`router`: the next MoE layer's experts from this layer's MoE input through the next layer's router."""
    name = "router"

    def __init__(self, converted, extra: int = 0):
        super().__init__(converted, extra)
        cfg, dense = converted.config, converted.dense
        self.cfg, self.dense = cfg, dense
        self.routers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.prefixes: dict[int, str] = {}            # the MoE block's prefix the family's route() takes
        names = get_family(cfg.model_type).names      # the family's router name (mlp.gate, mlp.router, ...)
        try:
            self.route = arch_module(cfg.model_type).route
        except (ValueError, AttributeError, ImportError):   # no forward module for this family: plain top-k
            self.route = None
        for L in self.layers[1:]:
            name = names.router_weight(L)
            w = dense.get(name)
            if w is not None and w.dim() == 2 and w.shape[0] == cfg.num_experts:
                bias = dense.get(name[: -len("weight")] + "e_score_correction_bias")
                self.routers[L] = (w.float().cpu(), None if bias is None else bias.float().cpu())
                self.prefixes[L] = name[: -len(names.router + ".weight")]

    @torch.inference_mode()
    def predict(self, layer: int, x: torch.Tensor, ids: np.ndarray | None = None) -> tuple[int | None, list[int]]:
        nxt = self.next.get(layer)
        if nxt is None or nxt not in self.routers:
            return None, []
        w, bias = self.routers[nxt]
        scores = x.detach().float().cpu() @ w.t()                              # (T, E)
        if bias is not None:
            scores = scores.sigmoid() + bias
        chosen = None
        if self.route is not None:
            try:
                chosen = self.route(self.cfg, self.dense, self.prefixes[nxt], x)[0].cpu().numpy()   # (T, k)
            except KeyError:           # a router tensor the family's route() reads is not where expected
                self.route = None
        return nxt, self._rank(nxt, scores.numpy(), chosen=chosen)


class CoactivationPredictor(_Scored):
    """`coact`: the next MoE layer's experts from the experts this layer routed each token to, by how often they
    were routed together before (counts learned from the model's own routing, online)."""
    name = "coact"

    def __init__(self, converted, extra: int = 0):
        super().__init__(converted, extra)
        E = self.n_experts
        self.counts = {L: np.zeros((E, E), dtype=np.float32) for L in self.layers[1:]}   # [a at prev, b at L]
        self.calls = {L: np.zeros(E, dtype=np.float32) for L in self.layers[1:]}        # a's tokens at prev
        self._ids: dict[int, np.ndarray] = {}          # the last routing per layer (T, k)
        self._last_sel: dict[int, np.ndarray] = {}     # the last token's routed experts per layer

    def learn(self, layer: int, ids: np.ndarray) -> None:
        """Layer `layer` routed `ids` (T, k): count each token's (expert at the previous layer, expert here)."""
        ids = np.asarray(ids)
        prev = self.prev.get(layer)
        before = self._ids.get(prev) if prev is not None else None
        if before is not None and before.shape[0] == ids.shape[0]:
            C, n = self.counts[layer], self.calls[layer]
            for a_row, b_row in zip(before, ids):
                a, b = a_row[a_row >= 0], b_row[b_row >= 0]
                np.add.at(C, (np.repeat(a, b.size), np.tile(b, a.size)), 1.0)
                np.add.at(n, a, 1.0)
        self._ids[layer] = ids
        last = ids[-1]
        self._last_sel[layer] = last[last >= 0]

    def predict(self, layer: int, x: torch.Tensor | None = None, ids: np.ndarray | None = None
                ) -> tuple[int | None, list[int]]:
        nxt = self.next.get(layer)
        if nxt is None or ids is None:
            return None, []
        ids = np.asarray(ids)
        C, n = self.counts[nxt], self.calls[nxt]
        P = C / np.maximum(n, 1.0)[:, None]                                     # (E, E): P(b at nxt | a here)
        scores = np.zeros((ids.shape[0], self.n_experts), dtype=np.float32)     # (T, E)
        prior = np.zeros(self.n_experts, dtype=np.float32)
        if nxt in self._last_sel:
            prior[self._last_sel[nxt]] = 1e-3        # ties and unlearned experts: the previous token's choice
        for t, row in enumerate(ids):
            a = row[row >= 0]
            if a.size:
                scores[t] = P[a].mean(axis=0)
            scores[t] += prior
        return nxt, self._rank(nxt, scores, floor=0.0)


def make_predictor(name: str, converted, extra: int = 0):
    if name == "router":
        return NextLayerPredictor(converted, extra)
    if name == "coact":
        return CoactivationPredictor(converted, extra)
    raise ValueError(f"--expert-ram-predictor {name!r}: use one of {', '.join(PREDICTORS)}")
