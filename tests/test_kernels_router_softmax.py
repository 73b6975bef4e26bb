"""kt_route_softmax (ABI 14; ktrun.ops.glue.route_softmax): the softmax router (Qwen3-MoE, Mixtral, DeepSeek-V2 greedy
and group_limited_greedy) for decode rows in one call. Held to a float64 numpy transcription of the reference routers
(transformers' Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock / DeepseekV2MoEGate: softmax over the experts, the
best single score per group when group-limited, top-k, renormalized when norm_topk_prob, times the scaling factor);
ties to the lower index; a token's result independent of the batch and of the ISA copy; the whole softmax_topk
router (models.routing) takes it for float32 CPU decode rows and keeps torch for prefill-sized batches and hooks."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from isa_copies import outputs_per_isa
from ktrun.models import choices, routing
from ktrun.ops import glue
from ktrun.ops.library import KernelError

# (experts, groups, groups kept, top-k, hidden, norm): Qwen3-30B-A3B, Mixtral, DeepSeek-V2 group-limited, small ones
CONFIGS = [(128, 1, 1, 8, 2048, True), (8, 1, 1, 2, 4096, True), (160, 8, 3, 6, 512, False), (64, 8, 3, 6, 256, True),
           (16, 4, 2, 2, 64, False)]


def _reference(x, w, n_group, topk_group, k, norm, scaling):
    """-> per token: {expert: weight} (float64), and the gap between the k-th and the next score."""
    logits = x.astype(np.float64) @ w.astype(np.float64).T
    e = np.exp(logits - logits.max(-1, keepdims=True))
    scores = e / e.sum(-1, keepdims=True)
    E = w.shape[0]
    out, gaps = [], []
    for t in range(x.shape[0]):
        s = scores[t].copy()
        if topk_group < n_group:
            g = s.reshape(n_group, -1).max(-1)
            keep = np.argsort(-g, kind="stable")[:topk_group]
            mask = np.zeros(n_group, bool)
            mask[keep] = True
            s[~np.repeat(mask, E // n_group)] = 0.0
        order = np.argsort(-s, kind="stable")
        ids = order[:k]
        wts = s[ids] / s[ids].sum() if norm else s[ids]
        out.append(dict(zip(ids.tolist(), (wts * scaling).tolist())))
        gaps.append(s[order[k - 1]] - s[order[k]] if k < E else np.inf)
    return out, gaps


@pytest.mark.parametrize("E,n_group,topk_group,k,K,norm", CONFIGS)
def test_against_float64_reference(E, n_group, topk_group, k, K, norm):
    g = torch.Generator().manual_seed(E + K)
    x = torch.randn(glue.ROUTE_MAX_ROWS, K, generator=g)
    w = torch.randn(E, K, generator=g) * K ** -0.5
    assert glue.route_sigmoid_supported(x, w, None)
    ids, wts = glue.route_softmax(x, w, n_group, topk_group, k, norm, 1.5)
    ref, gaps = _reference(x.numpy(), w.numpy(), n_group, topk_group, k, norm, 1.5)
    for t in range(x.shape[0]):
        if gaps[t] < 1e-6:            # a near-tie: float32 may pick either (none at these seeds; kept honest)
            continue
        assert set(ids[t].tolist()) == set(ref[t]), t
        got = dict(zip(ids[t].tolist(), wts[t].tolist()))
        for e, v in ref[t].items():
            assert got[e] == pytest.approx(v, rel=2e-5, abs=1e-7)
        assert all(wts[t][i] >= wts[t][i + 1] for i in range(k - 1)), "best first"


def test_ties_go_to_the_lower_index():
    x = torch.zeros(2, 64)                     # every logit 0: every score 1/16
    w = torch.randn(16, 64)
    ids, wts = glue.route_softmax(x, w, 1, 1, 4, False, 2.0)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2 and torch.all(wts == 0.125)
    ids, wts = glue.route_softmax(x, w, 4, 2, 3, True, 1.0)   # groups tie too: the first two groups
    assert ids.tolist() == [[0, 1, 2]] * 2 and torch.allclose(wts, torch.full((2, 3), 1 / 3))


def test_a_tokens_result_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 2048, generator=g), torch.randn(128, 2048, generator=g) * 0.05
    ids, wts = glue.route_softmax(x, w, 1, 1, 8, True, 1.0)
    for t in range(8):
        i1, w1 = glue.route_softmax(x[t:t + 1], w, 1, 1, 8, True, 1.0)
        assert torch.equal(i1[0], ids[t]) and torch.equal(w1[0], wts[t])


_DIGEST = """
import hashlib, torch
from ktrun.ops import glue
g = torch.Generator().manual_seed(5)
x, w = torch.randn(8, 2048, generator=g), torch.randn(128, 2048, generator=g) * 0.02
ids, wts = glue.route_softmax(x, w, 1, 1, 8, True, 1.0)
gi, gw = glue.route_softmax(x, w, 8, 3, 6, False, 2.5)
print(hashlib.sha256(ids.numpy().tobytes() + wts.numpy().tobytes() + gi.numpy().tobytes()
                     + gw.numpy().tobytes()).hexdigest())
"""


def test_every_isa_copy_gives_the_same_bits():
    digests = outputs_per_isa(_DIGEST)
    assert len(digests) >= 2 and len(set(digests.values())) == 1, digests


def _cfg(**kw):
    base = {"num_experts": 16, "n_group": 1, "topk_group": 1, "top_k": 4, "norm_topk_prob": True,
            "routed_scaling_factor": 1.0, "router_float32": False, "router_renormalizes": True, "topk_method": "greedy"}
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("cfg", [_cfg(), _cfg(norm_topk_prob=False, routed_scaling_factor=16.0),
                                 _cfg(router_renormalizes=False), _cfg(n_group=4, topk_group=2),   # greedy: no groups
                                 _cfg(n_group=4, topk_group=2, topk_method="group_limited_greedy")],
                         ids=["qwen3", "v2-scaled", "v2-no-renorm", "greedy-ignores-groups", "group-limited"])
def test_softmax_topk_takes_the_call_for_decode_rows_and_agrees_with_torch(cfg):
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(3, 64, generator=g), torch.randn(16, 64, generator=g) * 0.3
    ids, wts = routing.softmax_topk(cfg, x, w)                     # the C call (float32 CPU, 3 rows)
    seen = []

    def hook(kind, scores, chosen):
        seen.append(kind)
        return chosen
    with choices.choice_hook(hook):                                # the torch path, same config
        tids, twts = routing.softmax_topk(cfg, x, w)
    assert seen and ids.tolist() == tids.tolist()
    torch.testing.assert_close(wts, twts, rtol=1e-5, atol=1e-7)


def test_prefill_batches_and_other_dtypes_keep_the_torch_router():
    w = torch.randn(16, 64)
    assert not glue.route_sigmoid_supported(torch.randn(glue.ROUTE_MAX_ROWS + 1, 64), w, None)
    ids, _ = routing.softmax_topk(_cfg(), torch.randn(glue.ROUTE_MAX_ROWS + 1, 64), w)
    assert ids.shape == (glue.ROUTE_MAX_ROWS + 1, 4)
    ids, _ = routing.softmax_topk(_cfg(), torch.randn(2, 64, dtype=torch.bfloat16), w.bfloat16())
    assert ids.shape == (2, 4) and ids.dtype == torch.int64


def test_bad_arguments():
    x, w = torch.randn(1, 64), torch.randn(16, 64)
    for args in ((3, 1, 4), (1, 1, 17), (4, 5, 2)):   # 16 % 3, k > E, kept > groups
        with pytest.raises(KernelError, match="kt_route_softmax"):
            glue.route_softmax(x, w, *args, True, 1.0)
