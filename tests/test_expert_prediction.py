"""The RAM tier's next-layer predictors (ktrun.experts.prediction): the router predictor ranks the next layer's experts
as that layer's router would (checked against torch.topk on the same product), the co-activation predictor learns
which experts follow which from the routing it observes, and both score themselves (precision / recall)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ktrun.experts.prediction import CoactivationPredictor, NextLayerPredictor, make_predictor

E, K, H = 16, 2, 8
LAYERS = [1, 2, 3]


def fake_converted(dense=None, n_group=1, topk_group=1):
    """What the predictors read of a ConvertedModel: config (top_k, num_experts, moe_layers, what DeepSeek-V3's
    routing reads) and the dense tensors."""
    cfg = SimpleNamespace(model_type="deepseek_v3", top_k=K, num_experts=E, moe_layers=LAYERS, n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=1.0, scoring="sigmoid")
    return SimpleNamespace(config=cfg, dense=dense or {})


def test_router_predictor_ranks_as_the_next_router():
    gen = torch.Generator().manual_seed(0)
    dense = {f"model.layers.{L}.mlp.gate.weight": torch.randn(E, H, generator=gen) for L in LAYERS}
    p = NextLayerPredictor(fake_converted(dense), extra=1)
    x = torch.randn(3, H, generator=gen)                            # (T, H) layer 1's MoE input
    nxt, pred = p.predict(1, x)
    assert nxt == 2
    top = torch.topk(x @ dense["model.layers.2.mlp.gate.weight"].t(), K + 1, dim=-1).indices   # (T, K+1)
    assert set(pred) == set(top.flatten().tolist())
    assert p.predict(3, x) == (None, [])                            # the last MoE layer has no next one
    p.observe(2, set(top[:, :K].flatten().tolist()))
    assert p.recall == 1.0 and 0 < p.precision <= 1.0


def test_router_predictor_uses_the_correction_bias():
    """Families with sigmoid scores + e_score_correction_bias (DeepSeek-V3): the bias decides the ranking here."""
    w = torch.zeros(E, H)
    bias = torch.zeros(E)
    bias[[5, 11]] = 1.0
    dense = {f"model.layers.{L}.mlp.gate.weight": w for L in LAYERS}
    dense |= {f"model.layers.{L}.mlp.gate.e_score_correction_bias": bias for L in LAYERS}
    _, pred = NextLayerPredictor(fake_converted(dense)).predict(1, torch.ones(1, H))
    assert pred == [5, 11]


def test_router_predictor_keeps_the_group_limit():
    """DeepSeek-V3 routing keeps the topk_group groups with the best top-2 sums, then takes the top-k inside them:
    the prediction follows (group 0 = experts 0-3 scores 0.9, 0.8; group 1 = experts 4-7: one 0.95 alone; with one
    group kept, expert 4 is out although it scores best), and `extra` adds the best-scored others."""
    bias = torch.zeros(E)
    bias[[0, 1, 4]] = torch.tensor([0.9, 0.8, 0.95])
    dense = {f"model.layers.{L}.mlp.gate.weight": torch.zeros(E, H) for L in LAYERS}
    dense |= {f"model.layers.{L}.mlp.gate.e_score_correction_bias": bias for L in LAYERS}
    _, pred = NextLayerPredictor(fake_converted(dense, n_group=4, topk_group=1)).predict(1, torch.ones(1, H))
    assert pred == [0, 1]
    _, pred = NextLayerPredictor(fake_converted(dense, n_group=4, topk_group=1), extra=1).predict(1, torch.ones(1, H))
    assert pred == [4, 0, 1]                        # ranked by score; 4 only as the extra guess


def test_coactivation_predictor_learns_what_follows():
    """Routing where a token at expert a of one layer always goes to a+1 at the next: after some tokens the
    predictor names exactly those, precision and recall 1."""
    p = CoactivationPredictor(fake_converted())
    rng = np.random.default_rng(0)

    def step():
        ids1 = np.stack([rng.choice(E, K, replace=False) for _ in range(2)])     # (T=2, K)
        p.observe(1, set(ids1.flatten().tolist()), ids1)
        nxt, pred = p.predict(1, None, ids1)
        ids2 = (ids1 + 1) % E
        p.observe(2, set(ids2.flatten().tolist()), ids2)
        return nxt, pred, set(ids2.flatten().tolist())
    for _ in range(60):                                                          # learning
        step()
    p.stats = dict.fromkeys(p.stats, 0)
    for _ in range(10):
        nxt, pred, want = step()
        assert nxt == 2 and set(pred) == want
    assert p.precision == 1.0 and p.recall == 1.0


def test_coactivation_predictor_falls_back_to_the_previous_token():
    """Nothing learned for these experts yet: the previous token's selection at the next layer is the guess."""
    p = CoactivationPredictor(fake_converted())
    p.observe(2, {4, 9}, np.array([[4, 9]]))
    _, pred = p.predict(1, None, np.array([[0, 1]]))
    assert set(pred) == {4, 9}


def test_make_predictor_names_the_flag():
    assert isinstance(make_predictor("coact", fake_converted()), CoactivationPredictor)
    with pytest.raises(ValueError, match="--expert-ram-predictor"):
        make_predictor("oracle", fake_converted())
