"""Sparse attention checked choice by choice (DeepSeek-V3.2, GLM-5 and DeepSeek-V4's CSA layers): the lightning
indexer teacher-forced (observed: every set equal, 0 near-ties, scores bit-equal, on all three).

1. The same inputs into both indexers: transformers' forward of a long prompt runs; at every layer with an indexer
   its submodule's inputs (the layer's normed hidden states, the q LoRA activations, cos/sin, the causal mask) are
   captured with its top-k and the scores it took them from; ktrun's indexer (ktrun.models.indexer: project, then
   select, with the weights as ktrun loaded them from the conversion) runs on those very tensors. At every query
   position the two sets of selected keys are equal, except where transformers' k-th and (k+1)-th best scores lie
   within TIE_TOL of each other (relative to the row's top score): those rows are counted and reported, never
   silently passed. The scores themselves agree within SCORE_TOL.
2. The whole forward with the reference's choices forced: transformers' own choices (every router, group and
   indexer top-k) are recorded and ktrun is made to take them (discrete_choices.force_ktrun); its logits then equal
   transformers' within the bound of the conversion and backend.
A greedy run is never compared here: one flipped choice would make the rest of the run incomparable."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from discrete_choices import ChoiceLog, force_ktrun, force_transformers
from ktrun.engine import Engine
from ktrun.models import choices
from ktrun.models import indexer as lightning
from ktrun.models.kv_cache import Batch, causal_scores_mask
from ktrun.ops.library import kernels_available
from runtime_helpers import PROMPT, build_checkpoint, converted, reference_logits, shared_root, transformers_model

ARCHS = ("deepseek_v32", "glm_moe_dsa")
TEXT = PROMPT + " and then it jumps over the quick brown fox again and again, " + PROMPT
TIE_TOL = 1e-5          # a k-th / (k+1)-th score gap below this (relative) may order either way in float32
SCORE_TOL = 1e-5        # observed: 0 for both (float32 from the same bf16 weights, the same products)
# ktrun's logits with transformers' choices forced: float32 dense + reference experts as transformers (observed
# 3.3e-6 / 2.9e-6); the CPU kernels with int8 experts round activations (observed 1.6e-2 / 2.6e-2)
FORCED_ATOL = {("bf16", "reference"): 1e-4, ("int8-amx", "kernels"): 8e-2}


@pytest.fixture(scope="module", params=ARCHS)
def arch_ref(request, tmp_path_factory):
    src = build_checkpoint(shared_root(tmp_path_factory), request.param)
    return request.param, src, transformers_model(src)


@contextlib.contextmanager
def _capture_indexers(model):
    """Every indexer submodule's call: yields {layer: (kwargs-as-called inputs, the (T, N) scores its topk saw, its
    (T, k) ids)} filled during the block."""
    seen: dict[int, dict] = {}
    orig_topk = torch.Tensor.topk
    current: list[int] = []

    def topk(x, k, dim=-1, largest=True, sorted=True):
        out = orig_topk(x, k, dim=dim, largest=largest, sorted=sorted)
        if current and x.dim() == 3:                  # the indexer's (1, T, N) index scores
            seen[current[-1]]["scores"] = x[0].detach().clone()
        return out

    handles = []
    for name, m in model.named_modules():
        if name.endswith("self_attn.indexer") and m is not None:
            layer = int(name.split(".layers.")[1].split(".")[0])

            def pre(_m, args, kwargs, layer=layer):
                names = ("hidden_states", "q_resid", "position_embeddings", "attention_mask")
                seen[layer] = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
                current.append(layer)

            def post(_m, _args, _kwargs, out, layer=layer):
                seen[layer]["ids"] = out[0].long().clone()
                current.pop()
            handles += [m.register_forward_pre_hook(pre, with_kwargs=True),
                        m.register_forward_hook(post, with_kwargs=True)]
    try:
        with mock.patch.object(torch.Tensor, "topk", topk):
            yield seen
    finally:
        for h in handles:
            h.remove()


def _ours(eng: Engine, layer: int, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """ktrun's indexer on transformers' inputs of one layer -> (scores (T, T), ids (T, k)) of its top-k."""
    model, cfg = eng.model, eng.model.cfg
    x, q_resid = inputs["hidden_states"][0].float(), inputs["q_resid"][0].float()             # (T, H), (T, q_lora)
    T = x.shape[0]
    cos, sin = model.rope.cos_sin(torch.arange(T), torch.float32)
    p = model.names.layer(layer) + "self_attn."
    ix = lightning.project(cfg, model.w, p, x, q_resid, model.rope, cos, sin)
    got = {}

    def hook(kind, scores, ids):
        got.update(scores=scores.detach().clone(), ids=ids)
        return ids
    with choices.choice_hook(hook):
        lightning.select(cfg, ix.q, ix.k, ix.weights, causal_scores_mask(T, 0, T, x.device))
    return got["scores"], got["ids"]


class Tally:
    """Query rows with a choice compared over one model's indexer layers: equal sets, near-ties (transformers' k-th
    and (k+1)-th scores within TIE_TOL of each other, relative to the row's top score) and the worst score error;
    any other difference fails at once."""

    def __init__(self, arch: str, k: int):
        self.arch, self.k = arch, k
        self.rows = self.equal = self.ties = 0
        self.worst_score = 0.0

    def layer(self, layer: int, theirs: torch.Tensor, scores: torch.Tensor, mine: list[set], want: list[set],
              has_choice: list[bool]) -> None:
        """theirs / scores: (T, N) the two indexers' scores (-inf where unseen); mine / want: each query's set."""
        finite = torch.isfinite(theirs)
        assert torch.equal(finite, torch.isfinite(scores)), f"layer {layer}: the two see different keys"
        top = theirs.masked_fill(~finite, 0).abs().amax(-1, keepdim=True).clamp_min(1e-30)
        if finite.any():
            self.worst_score = max(self.worst_score, float(((scores - theirs).abs() / top)[finite].max()))
        for t, choice in enumerate(has_choice):
            if not choice:                                 # at most k keys visible: every one is taken
                continue
            self.rows += 1
            if mine[t] == want[t]:
                self.equal += 1
                continue
            ordered = theirs[t].sort(descending=True).values
            gap = float(ordered[self.k - 1] - ordered[self.k]) / float(top[t])
            assert gap <= TIE_TOL, f"{self.arch} layer {layer} position {t}: selections differ " \
                                   f"{sorted(mine[t] ^ want[t])} but transformers' k-th and (k+1)-th scores are " \
                                   f"{gap:.2e} apart"
            self.ties += 1

    def report(self, layers: list[int]) -> None:
        print(f"{self.arch}: {self.rows} query rows with a choice over layers {layers}: {self.equal} equal sets, "
              f"{self.ties} near-ties (k-th / (k+1)-th gap <= {TIE_TOL:g}); max score error {self.worst_score:.1e} "
              f"of the row's top")
        assert self.rows > 0 and self.equal + self.ties == self.rows
        assert self.worst_score <= SCORE_TOL


def test_indexer_selection_teacher_forced_at_every_position(tmp_path_factory, arch_ref):
    arch, _src, ref = arch_ref
    eng = Engine(converted(tmp_path_factory, arch, "bf16"), ctx=256, use_kernels=False)
    cfg, k = eng.model.cfg, eng.model.cfg.index_topk
    ids = eng.tokenizer.encode(TEXT)
    assert len(ids) > 8 * k
    with _capture_indexers(ref) as seen, torch.no_grad():
        ref(torch.tensor([ids]))
    full = [i for i in range(cfg.num_layers) if not cfg.indexer_types or cfg.indexer_types[i] == "full"]
    assert sorted(seen) == full and (arch != "glm_moe_dsa" or full == [0, 1, 4])
    tally = Tally(arch, k)
    for layer, inputs in seen.items():
        scores, got_ids = _ours(eng, layer, inputs)
        tally.layer(layer, inputs["scores"], scores, [set(r.tolist()) for r in got_ids],
                    [set(r.tolist()) for r in inputs["ids"]], [t + 1 > k for t in range(len(ids))])
    eng.close()
    tally.report(full)
    assert tally.rows == len(full) * (len(ids) - k)


@pytest.mark.parametrize("method, backend", [("bf16", "reference"), pytest.param(
    "int8-amx", "kernels", marks=pytest.mark.skipif(not kernels_available(), reason="kernels not available"))])
def test_logits_with_the_reference_choices_forced(tmp_path_factory, arch_ref, method, backend):
    """transformers' own choices recorded (every router, group and indexer top-k at every position), ktrun made to
    take each of them: the logits then agree within the bound, whatever near-ties the two would break apart."""
    arch, _src, ref = arch_ref
    eng = Engine(converted(tmp_path_factory, arch, method), ctx=256, use_kernels=backend == "kernels")
    cfg = eng.model.cfg
    ids = eng.tokenizer.encode(TEXT)
    with force_transformers(ref, cfg, ChoiceLog()) as theirs:
        want = reference_logits(ref, ids)
    assert {kind for kind, _l, _p in theirs.rows} == {"router", "router_group", "indexer"}
    with force_ktrun(cfg, theirs) as own:               # asserts every recorded choice was asked for and taken
        got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    eng.close()
    differ = sum(1 for key, c in own.rows.items() if c.taken() != theirs.rows[key].taken())
    diff = (got - want).abs().max().item()
    print(f"{arch} {method} {backend}: {len(theirs.rows)} choices forced ({differ} where ktrun's own differed); "
          f"max |logit diff| {diff:.2e}")
    assert diff < FORCED_ATOL[method, backend]


# --- DeepSeek-V4: the CSA layers' indexer over compressed entries ---------------------------------------------------
@contextlib.contextmanager
def _capture_v4_indexers(model):
    """Every DeepseekV4Indexer call: {layer: {"x", "q_res", "positions", "scores" (S, E) as its topk saw them,
    "ids" (S, k), -1 where the query may see fewer than k entries}}."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer
    seen: dict[int, dict] = {}
    orig_topk = torch.Tensor.topk
    current: list[int] = []

    def topk(x, k, dim=-1, largest=True, sorted=True):
        if current and x.dim() == 3:                  # the indexer's (1, S, E) index scores
            seen[current[-1]]["scores"] = x[0].detach().clone()
        return orig_topk(x, k, dim=dim, largest=largest, sorted=sorted)

    def pre(_m, args, kwargs):
        layer = args[4] if len(args) > 4 else kwargs["layer_idx"]
        seen[layer] = {"x": args[0][0].detach().float(), "q_res": args[1][0].detach().float(),
                       "positions": args[2][0].detach()}
        current.append(layer)

    def post(_m, _args, _kwargs, out):
        seen[current.pop()]["ids"] = out[0].long().clone()

    handles = []
    for m in model.modules():
        if isinstance(m, DeepseekV4Indexer):
            handles += [m.register_forward_pre_hook(pre, with_kwargs=True),
                        m.register_forward_hook(post, with_kwargs=True)]
    try:
        with mock.patch.object(torch.Tensor, "topk", topk):
            yield seen
    finally:
        for h in handles:
            h.remove()


def test_deepseek_v4_indexer_teacher_forced_at_every_position(tmp_path_factory):
    """DeepSeek-V4's CSA layers: transformers' indexer inputs (the attention's normed input, its q LoRA activations,
    the positions) into ktrun's indexer (deepseek_v4_attention._indexer_pick, its own compressor over the same rows):
    at every query with more visible compressed entries than index_topk, equal sets except near-ties (counted)."""
    from ktlayouts.families.deepseek_v4 import CSA
    from ktrun.models import deepseek_v4 as v4
    from ktrun.models import deepseek_v4_attention as v4attn
    from ktrun.ops.packed_linear import linear

    src = build_checkpoint(shared_root(tmp_path_factory), "deepseek_v4")
    ref = transformers_model(src)
    eng = Engine(converted(tmp_path_factory, "deepseek_v4", "bf16"), ctx=256, use_kernels=False)
    model, cfg = eng.model, eng.model.cfg
    st = v4._state(model)
    s, k = st["s"], cfg.index_topk
    rate = s.compress_rate(CSA)
    ids = eng.tokenizer.encode(" ".join([TEXT] * 2))
    assert len(ids) > 4 * rate * k                          # many more entries than picks for the late queries
    with _capture_v4_indexers(ref) as seen, torch.no_grad():
        ref(torch.tensor([ids]))
    csa = [i for i, t in enumerate(cfg.layer_types) if t == CSA]
    assert sorted(seen) == csa and csa
    tally = Tally("deepseek_v4", k)
    for layer, inp in seen.items():
        p = model.names.layer(layer) + "attn."
        ic = p + "indexer.compressor."
        x, q_res, pos = inp["x"], inp["q_res"], inp["positions"]
        S = x.shape[0]
        cos, sin = st["ropes"]["compress"].cos_sin(pos, torch.float32)
        ikv, igate = linear(x, model.w[ic + "wkv.weight"]), linear(x, model.w[ic + "wgate.weight"])
        E = S // rate
        allowed = torch.arange(E)[None, :] < ((pos + 1) // rate)[:, None]                  # (S, E)
        got = {}

        def hook(kind, scores, chosen, got=got):
            got.update(scores=scores.detach().clone(), ids=chosen)
            return chosen
        with choices.choice_hook(hook), torch.no_grad():
            v4attn._indexer_pick(cfg, s, model.w, p, x, q_res, ikv, igate, rate, cfg.rms_norm_eps,
                                 st["ropes"]["compress"], cos, sin, allowed, torch.float32)
        mine = [{i for i in r.tolist() if i < E and allowed[t, i]} for t, r in enumerate(got["ids"])]
        want = [{i for i in r.tolist() if i >= 0} for r in inp["ids"]]
        tally.layer(layer, inp["scores"], got["scores"][:, :E], mine, want,
                    (allowed.sum(-1) > k).tolist())
    eng.close()
    tally.report(csa)
