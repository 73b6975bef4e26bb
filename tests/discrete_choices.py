"""Compare two forwards at their discrete choices: each router's top-k of experts and DeepSeek-V3.2's indexer top-k
of keys, per (kind, layer, position).

A forward whose continuous parts carry rounding (int8 activations per group, bf16) may cross a near-tie that the
reference does not: two experts 2e-5 apart, two keys 0.3% of the top score apart. No precision removes such a
tie, and one flipped choice changes that position's logits outright. So the tests

  1. record the forward under test's choices and scores (`record_ktrun`, through ktrun.models.choices);
  2. run the reference with those choices forced (`force_ktrun` for ktrun's dequantized-at-load path,
     `force_transformers` for transformers: its routers' and indexer's topk calls answered with the recorded ids),
     logging the reference's own choices and scores at each of them; the logits are then held to the usual bounds;
  3. check every place where the two chose differently is a near-tie of the reference's own scores
     (`TieReport.check`): the reference's best score left out minus its worst score taken in, relative to the row's
     top score, within a stated bound; and the scores themselves within a stated relative error.

Rows the forward under test made no choice for (the indexer while a query sees at most index_topk keys, the last
position of a greedy continuation) keep the reference's own choice.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from unittest import mock

import torch
from ktrun.models import arch_module, choices


@dataclass
class Choice:
    scores: torch.Tensor      # (N,) float32: what the choice was made on (-inf: not selectable)
    ids: torch.Tensor         # (k,) int64: the indices taken

    def taken(self) -> set[int]:
        """The selectable indices taken (a query's top-k may include keys it cannot see)."""
        return {int(i) for i in self.ids if math.isfinite(float(self.scores[i]))}


@dataclass
class ChoiceLog:
    rows: dict[tuple[str, int, int], Choice] = field(default_factory=dict)    # (kind, layer, position) -> Choice
    used: set = field(default_factory=set)                                     # rows forced_ids() answered with

    def add(self, kind: str, layer: int, positions: range, scores: torch.Tensor, ids: torch.Tensor) -> None:
        for r, pos in enumerate(positions):
            self.rows[kind, layer, pos] = Choice(scores[r].detach().float().cpu().clone(), ids[r].cpu().clone())

    def forced_ids(self, kind: str, layer: int, positions: range, own: torch.Tensor) -> torch.Tensor:
        """own: (T, k) -> the recorded ids where there are some, own elsewhere."""
        out = own.clone()
        for r, pos in enumerate(positions):
            c = self.rows.get((kind, layer, pos))
            if c is not None:
                assert c.ids.numel() == own.shape[1], f"{kind} layer {layer} position {pos}: k differs"
                out[r] = c.ids.to(own.device)
                self.used.add((kind, layer, pos))
        return out

    def assert_all_used(self) -> None:
        """Every recorded choice was taken: the two forwards' choices lined up (kind, layer, position)."""
        left = sorted(set(self.rows) - self.used)
        assert not left, f"{len(left)} recorded choices were never asked for, e.g. {left[:3]}"


class _KtrunSites:
    """ktrun's top_k calls -> (layer, positions): each forward calls the routers in MoE-layer order and the indexer
    in the order of the layers that run one (one request per forward in these tests); router rows are the next positions of that layer,
    an indexer call's (n, S) scores are the queries at positions S-n..S-1."""

    def __init__(self, cfg):
        self.sites = {"router": list(cfg.moe_layers), "router_group": list(cfg.moe_layers),
                      "indexer": [i for i in range(cfg.num_layers)          # GLM-5.2's shared layers run none
                                  if not cfg.indexer_types or cfg.indexer_types[i] == "full"]}
        arch = arch_module(cfg.model_type)      # a family whose layers choose otherwise says where (DeepSeek-V4)
        layers_of = getattr(arch, "choice_layers", None)
        if layers_of is not None:
            self.sites.update(layers_of(cfg))
        # an indexer choosing among compressed entries rather than positions (DeepSeek-V4): its rows are the
        # queries, located in order as the routers' are
        self.indexer_by_query = getattr(arch, "INDEXER_OVER_ENTRIES", False)
        self.calls = {k: 0 for k in self.sites}
        self.next_pos: dict[tuple[str, int], int] = {}

    def locate(self, kind: str, scores: torch.Tensor) -> tuple[int, range]:
        layers = self.sites[kind]
        layer = layers[self.calls[kind] % len(layers)]
        self.calls[kind] += 1
        n = scores.shape[0]
        if kind == "indexer" and not self.indexer_by_query:
            return layer, range(scores.shape[1] - n, scores.shape[1])
        start = self.next_pos.get((kind, layer), 0)
        self.next_pos[kind, layer] = start + n
        return layer, range(start, start + n)


@contextlib.contextmanager
def record_ktrun(cfg):
    """Within the block ktrun's choices are logged (and kept): yields the ChoiceLog."""
    log, sites = ChoiceLog(), _KtrunSites(cfg)

    def hook(kind, scores, ids):
        layer, positions = sites.locate(kind, scores)
        log.add(kind, layer, positions, scores, ids)
        return ids

    with choices.choice_hook(hook):
        yield log


@contextlib.contextmanager
def force_ktrun(cfg, forced: ChoiceLog):
    """Within the block ktrun takes forced's choices; yields the ChoiceLog of its own ones."""
    own, sites = ChoiceLog(), _KtrunSites(cfg)

    def hook(kind, scores, ids):
        layer, positions = sites.locate(kind, scores)
        own.add(kind, layer, positions, scores, ids)
        return forced.forced_ids(kind, layer, positions, ids)

    forced.used.clear()
    with choices.choice_hook(hook):
        yield own
    forced.assert_all_used()


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


@contextlib.contextmanager
def force_transformers(model, cfg, forced: ChoiceLog):
    """Within the block the transformers model (one sequence per forward, from position 0) takes forced's choices;
    yields the ChoiceLog of its own ones. Its choices are the topk calls inside a decoder layer on a router's (T, E)
    scores with k = top_k, and on the indexer's (1, S, T) scores with k = min(index_topk, T); forced ids are
    answered with their scores gathered, as topk answers."""
    own, where = ChoiceLog(), {"layer": None}
    calls = dict.fromkeys(choices.KINDS, 0)
    orig_fn = torch.topk
    handles = []
    for name, m in model.named_modules():
        hit = _LAYER.search(name)
        if hit and "vision" not in name:
            handles.append(m.register_forward_pre_hook(lambda _m, _a, i=int(hit[1]): where.update(layer=i)))
            handles.append(m.register_forward_hook(lambda *_: where.update(layer=None)))

    def kind_of(x: torch.Tensor, k: int) -> str | None:
        if where["layer"] is None:
            return None
        # the router's scores: LongCat-Flash's also cover its zero (identity) experts
        if x.dim() == 2 and x.shape[-1] == cfg.num_experts + cfg.zero_experts and k == cfg.top_k:
            return "router"
        if x.dim() == 2 and 1 < cfg.n_group == x.shape[-1] and k == cfg.topk_group:
            return "router_group"
        if x.dim() == 3 and x.shape[0] == 1 and cfg.index_topk and k == min(cfg.index_topk, x.shape[-1]):
            return "indexer"
        return None

    def topk(x, k, dim=-1, largest=True, sorted=True):
        kind = kind_of(x, k)
        if kind is None or dim not in (-1, x.dim() - 1) or not largest:
            return orig_fn(x, k, dim=dim, largest=largest, sorted=sorted)
        calls[kind] += 1
        rows = x[0] if kind == "indexer" else x                                 # (T, N)
        ids = orig_fn(rows, k, dim=-1, sorted=sorted).indices
        positions = range(rows.shape[0])
        own.add(kind, where["layer"], positions, rows, ids)
        ids = forced.forced_ids(kind, where["layer"], positions, ids)
        vals = rows.gather(-1, ids)
        if kind == "indexer":
            vals, ids = vals[None], ids[None]
        return torch.return_types.topk((vals, ids))

    forced.used.clear()
    try:
        with mock.patch.object(torch, "topk", topk), mock.patch.object(torch.Tensor, "topk", topk):
            yield own
    finally:
        for h in handles:
            h.remove()
    missed = [k for k, need in (("router", cfg.num_experts), ("indexer", cfg.index_topk)) if need and not calls[k]]
    assert not missed, f"no {missed} topk call was seen in the transformers forward: the interception missed it"
    forced.assert_all_used()


@dataclass
class Flip:
    kind: str
    layer: int
    position: int
    margin: float             # the reference's best score left out minus its worst taken in, / the row's top score
    score_error: float        # max |got - ref| over the row's selectable scores, / the row's top score


@dataclass
class TieReport:
    rows: dict[str, int]      # kind -> rows where both forwards chose (more selectable entries than k)
    flips: list[Flip]
    score_error: dict[str, float]     # kind -> max over its rows

    def check(self, score_bound: dict[str, float]) -> None:
        """The choice scores within score_bound[kind] of the row's top score, and every flip a near-tie the measured
        score difference explains: margin <= 2 x the row's score error (a flip needs each of the two scores to move
        by half the gap; also proves both took the top-k of the scores logged) <= 2 x score_bound[kind]."""
        assert sum(self.rows.values()), "no choice was compared"
        for kind, err in self.score_error.items():
            assert err <= score_bound[kind], \
                f"{kind}: choice scores differ by {err:.2e} of the row's top score (bound {score_bound[kind]:.1e})"
        bad = [f for f in self.flips if not f.margin <= 2 * f.score_error]
        assert not bad, f"choices differ beyond what the scores' difference explains: {bad[:4]}"

    def __str__(self) -> str:
        parts = []
        for kind, n in self.rows.items():
            fl = [f.margin for f in self.flips if f.kind == kind]
            parts.append(f"{kind}: {n} rows, score error {self.score_error[kind]:.2e}, {len(fl)} flips"
                         + (f" (margins {min(fl):.1e}..{max(fl):.1e})" if fl else ""))
        return "; ".join(parts)


def compare(got: ChoiceLog, ref: ChoiceLog) -> TieReport:
    """got: the forward under test's choices; ref: the forced reference's own choices and scores."""
    rows: dict[str, int] = {}
    flips, err = [], {}
    for key, r in ref.rows.items():
        g = got.rows.get(key)
        width = min(r.scores.numel(), g.scores.numel()) if g is not None else 0
        s = r.scores[:width]
        selectable = torch.isfinite(s)
        if g is None or int(selectable.sum()) <= r.ids.numel():     # no choice made: everything selectable taken
            continue
        kind = key[0]
        rows[kind] = rows.get(kind, 0) + 1
        both = selectable & torch.isfinite(g.scores[:width])
        scale = float(s[selectable].abs().max())
        row_err = float((g.scores[:width][both] - s[both]).abs().max()) / scale if both.any() else math.inf
        err[kind] = max(err.get(kind, 0.0), row_err)
        mine, theirs = r.taken(), g.taken()
        if mine == theirs:
            continue
        left_out, taken_in = mine - theirs, theirs - mine
        margin = (max(float(s[i]) for i in left_out) - min(float(s[i]) for i in taken_in)) / scale \
            if left_out and taken_in else math.inf
        flips.append(Flip(*key, margin=margin, score_error=row_err))
    return TieReport(rows, flips, err)


def prompt_and_greedy_with_choices(eng, ids: list[int], n: int):
    """One ktrun engine (one request): the prompt's (T, V) logits and n greedy tokens after it, each with the choices
    its forwards made. -> (logits, their ChoiceLog, tokens, their ChoiceLog); the engine is closed."""
    from ktrun.models.kv_cache import Batch
    try:
        with record_ktrun(eng.model.cfg) as choices:
            logits = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
        gen, gen_choices = greedy_with_choices(eng, ids, n)
    finally:
        eng.close()
    return logits.float(), choices, gen, gen_choices


def greedy_with_choices(eng, ids: list[int], n: int) -> tuple[list[int], ChoiceLog]:
    """n greedy tokens after ids from the ktrun engine (one request), with the choices its forwards made."""
    from ktrun.sampling import SamplingParams
    gen: list[int] = []
    with record_ktrun(eng.model.cfg) as log:
        eng.add_request("greedy", ids, SamplingParams(max_tokens=n, ignore_eos=True))
        while eng.has_work():
            gen += [t for _r, t, _f in eng.step()]
    return gen, log
