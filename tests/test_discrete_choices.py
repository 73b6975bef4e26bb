"""The discrete-choice seam (ktrun.models.choices) and the tests' tie analysis (discrete_choices.py): the hook sees
and replaces every router / group / indexer top-k; forcing transformers with ktrun's recorded choices changes
nothing where they agree, forcing other choices is taken (the logits move) and is caught as no near-tie."""
from __future__ import annotations

import pytest
import torch
from discrete_choices import Choice, ChoiceLog, compare, force_transformers, record_ktrun
from ktrun.engine import Engine
from ktrun.models import choices
from ktrun.models.kv_cache import Batch
from runtime_helpers import PROMPT, build_checkpoint, converted, reference_logits, shared_root, transformers_model


def test_top_k_is_torch_topk_until_a_hook_replaces_it():
    s = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.3, 0.2, 0.8, 0.1]])
    assert [set(r.tolist()) for r in choices.top_k("router", s, 2)] == [{1, 3}, {0, 2}]
    seen = []

    def hook(kind, scores, ids):
        seen.append((kind, scores.shape, ids.shape))
        return torch.zeros_like(ids)

    with choices.choice_hook(hook):
        assert choices.top_k("indexer", s, 2).tolist() == [[0, 0], [0, 0]]
        with pytest.raises(RuntimeError, match="already installed"), choices.choice_hook(hook):
            pass
    assert seen == [("indexer", (2, 4), (2, 2))]
    assert set(choices.top_k("router", s, 1).flatten().tolist()) == {1, 2}     # the hook is gone


def _log(scores, ids) -> ChoiceLog:
    log = ChoiceLog()
    log.rows["router", 0, 0] = Choice(torch.tensor(scores), torch.tensor(ids))
    return log


@pytest.mark.parametrize("sorted_", [False, True])
def test_indexer_ties_go_to_the_lower_index_whatever_the_row_holds(sorted_):
    """relu'd index scores: many exact zeros. The picks are the k best by (score desc, index asc), computed here by
    Python's sort, for the row alone and with later keys (masked, -inf) or lower scores appended: the same picks."""
    g = torch.Generator().manual_seed(5)
    scores = torch.relu(torch.randn(64, 40, generator=g)).round(decimals=1)       # exact ties, zeros and others
    scores[:8, :] = 0.0                                                           # rows of nothing but ties
    scores[8:16, 30:] = float("-inf")                                             # fewer visible keys than k + 1
    k = 12
    for extra in (0, 1, 7, 300):
        row = torch.cat([scores, torch.full((64, extra), float("-inf"))], dim=1)
        row[:, 40:40 + extra // 2] = -1.0                                         # and lower, finite scores
        got = choices.top_k("indexer", row, k, sorted=sorted_).tolist()
        for r, picks in zip(row.tolist(), got):
            want = sorted(range(len(r)), key=lambda i: (-r[i], i))[:k]
            assert picks == (want if sorted_ else sorted(want)), (extra, r, picks)


def test_a_flip_passes_only_as_a_near_tie_its_score_difference_explains():
    ref = _log([0.5, 0.30001, 0.1, 0.3], [0, 1])
    near = _log([0.5, 0.29999, 0.1, 0.30002], [0, 3])          # 1 and 3, 1e-5 apart, swapped by 2e-5 moves
    rep = compare(near, ref)
    assert rep.rows == {"router": 1} and len(rep.flips) == 1
    assert rep.flips[0].margin == pytest.approx(2e-5, rel=1e-2)               # / the top score 0.5
    assert rep.score_error["router"] == pytest.approx(4e-5, rel=1e-2)
    rep.check({"router": 1e-3})
    with pytest.raises(AssertionError, match="differ by"):
        rep.check({"router": 1e-5})                            # the scores themselves are held to their bound
    far = _log([0.5, 0.30001, 0.1, 0.3], [0, 2])               # took 0.1 over 0.30001 on the same scores: a bug
    with pytest.raises(AssertionError, match="beyond what the scores' difference explains"):
        compare(far, ref).check({"router": 1e-3})
    # a row where everything selectable is taken is no choice (a query that sees at most top-k keys)
    few = _log([0.5, float("-inf"), 0.2, float("-inf")], [0, 2])
    assert compare(few, few).rows == {}


def test_forcing_transformers_takes_the_choices_given(tmp_path_factory):
    """DeepSeek-V3.2 (routers, groups and the indexer): with ktrun's own choices transformers' logits are as without
    forcing (they agree everywhere: no flip); with every choice turned into the worst one, they move and the check
    sees choices far from any tie."""
    arch = "deepseek_v32"
    src = build_checkpoint(shared_root(tmp_path_factory), arch)
    ref = transformers_model(src)
    eng = Engine(converted(tmp_path_factory, arch, "bf16"), ctx=256, use_kernels=False)
    try:
        ids = eng.tokenizer.encode(PROMPT + " " + PROMPT)
        with record_ktrun(eng.model.cfg) as log:
            got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
        cfg = eng.model.cfg
    finally:
        eng.close()
    assert {k for k, _l, _p in log.rows} == {"router", "router_group", "indexer"}
    free = reference_logits(ref, ids)
    with force_transformers(ref, cfg, log) as own:
        forced = reference_logits(ref, ids)
    rep = compare(log, own)
    assert not rep.flips and (forced - free).abs().max() < 1e-5 and (forced - got).abs().max() < 1e-4, rep
    rep.check(dict.fromkeys(choices.KINDS, 1e-5))
    worst = ChoiceLog({key: Choice(c.scores, torch.topk(c.scores.nan_to_num(neginf=1e9), c.ids.numel(),
                                                        largest=False).indices)
                       for key, c in log.rows.items()})
    with force_transformers(ref, cfg, worst) as own:
        moved = reference_logits(ref, ids)
    assert (moved - free).abs().max() > 0.1
    with pytest.raises(AssertionError, match="beyond what the scores' difference explains"):
        compare(worst, own).check(dict.fromkeys(choices.KINDS, float("inf")))
