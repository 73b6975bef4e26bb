"""DeepSeek-V4 in ktrun against transformers (DeepseekV4ForCausalLM, the release's tensor names read back by its
conversion mapping): hyper-connections, sliding-window attention with sinks, CSA (compressor + lightning indexer)
and HCA layers, grouped output projection, sqrt-softplus and hash routing, on a prompt several windows / compression
rates long, prefilled whole and in chunks then decoded token by token, and 32 greedy tokens; choices that are
near-ties (the indexer's relu'd scores are often exact ties at these scales) are compared tie-aware: ktrun's choices
forced on transformers, every flip a near-tie of transformers' own scores (tests/discrete_choices.py).

The fixture's swiglu_limit (0.5) binds at these scales, in the routed experts (the executors' "silu_clamped": the
kernels' KT_ACT_SILU_CLAMPED or the torch reference) and in the shared expert; test_the_clamp_binds shows it moves
transformers' logits."""
from __future__ import annotations

import random
import re
import subprocess

import pytest
import torch
from discrete_choices import compare, force_transformers, greedy_with_choices, record_ktrun
from ktrun.engine import Engine
from ktrun.models.choices import choice_hook
from ktrun.models.kv_cache import Batch
from ktrun.ops.library import kernels_available
from runtime_helpers import (
    INIT_SCALE,
    KTRUN,
    PROMPT,
    build_conversion,
    greedy_gaps,
    kl,
    shared_root,
    transformers_model,
)

from ktconvert.testing import make_checkpoint

# float32 on both sides from identical weights (observed max |logit diff| ~3e-6 at logit scale ~6)
LOGIT_ATOL = 1e-4
# bf16 kernel experts round activations to bf16
KERNEL_ATOL = 5e-2
# int8 / int4 g32 re-quantized experts: KL bounds (tests/test_runtime_quantized.py's house bounds)
KL_MEAN = {"int8-amx": 1e-3, "int4-amx": 1e-2}
# the indexer's and routers' choice scores, relative to the row's top score (kernels: bf16 expert activations)
SCORE_BOUND = {"reference": {"router": 1e-3, "indexer": 1e-3}, "kernels": {"router": 2e-2, "indexer": 2e-2}}
BACKENDS = ["reference", pytest.param("kernels", marks=pytest.mark.skipif(
    not kernels_available(), reason="libktkernels not available on this machine"))]
N_GREEDY = 32


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = shared_root(tmp_path_factory) / "src_deepseek_v4"
    if not (d / "config.json").exists():
        make_checkpoint("deepseek_v4", d, init_scale=INIT_SCALE)
    return d


@pytest.fixture(scope="module")
def ref(src):
    return transformers_model(src)


def _conv(src, tmp_path_factory, method):
    return build_conversion(src, shared_root(tmp_path_factory) / f"conv_deepseek_v4_{method}", method)


def _ids(eng) -> list[int]:
    ids = eng.tokenizer.encode(" ".join([PROMPT] * 3))
    assert len(ids) > 8 * 6          # past the window (6) many times, 12+ HCA entries (8), 24 CSA entries (4)
    return ids


def _forced_reference(ref, cfg, log, ids):
    with force_transformers(ref, cfg, log) as own, torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].float()
    return logits, compare(log, own)


def _chunked(eng, ids):
    cache = eng.model.new_cache(256)
    parts = [ids[:7], ids[7:16]] + [[t] for t in ids[16:]]
    return torch.cat([eng.model.forward(Batch.build([(cache, p)], "cpu"), all_logits=True) for p in parts])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunked", [False, True], ids=["prefill", "chunked_decode"])
def test_logits_match_transformers(src, ref, tmp_path_factory, backend, chunked):
    eng = Engine(_conv(src, tmp_path_factory, "bf16"), ctx=256, use_kernels=backend == "kernels")
    try:
        ids = _ids(eng)
        with record_ktrun(eng.model.cfg) as log:
            got = _chunked(eng, ids) if chunked else eng.model.forward(
                Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
        want, ties = _forced_reference(ref, eng.model.cfg, log, ids)
    finally:
        eng.close()
    ties.check(SCORE_BOUND[backend])
    print(f"\n{backend} {'chunked' if chunked else 'prefill'}: max |logit diff| "
          f"{(got - want).abs().max():.3g}; {ties}")
    assert ties.rows["indexer"] > 0 and ties.rows["router"] > 0
    assert (got - want).abs().max() < (LOGIT_ATOL if backend == "reference" else KERNEL_ATOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_32_tokens_are_transformers_argmax(src, ref, tmp_path_factory, backend):
    eng = Engine(_conv(src, tmp_path_factory, "bf16"), ctx=256, use_kernels=backend == "kernels")
    try:
        ids = _ids(eng)
        gen, log = greedy_with_choices(eng, ids, N_GREEDY)
        cfg = eng.model.cfg
    finally:
        eng.close()
    assert len(gen) == N_GREEDY
    want, ties = _forced_reference(ref, cfg, log, ids + gen[:-1])
    ties.check(SCORE_BOUND[backend])
    gaps = greedy_gaps(want, len(ids), gen)
    print(f"\n{backend}: greedy gaps max {max(gaps):.3g}; {ties}")
    assert max(gaps) <= (1e-3 if backend == "reference" else 3e-2), gaps


@pytest.mark.parametrize("method", ["int8-amx", "int4-amx"])
def test_quantized_experts_on_the_kernels(src, ref, tmp_path_factory, method):
    if not kernels_available():
        pytest.skip("libktkernels not available on this machine")
    eng = Engine(_conv(src, tmp_path_factory, method), ctx=256, use_kernels=True)
    try:
        ids = _ids(eng)
        with record_ktrun(eng.model.cfg) as log:
            got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    finally:
        eng.close()
    want, ties = _forced_reference(ref, eng.model.cfg, log, ids)   # ktrun's choices on quantized experts, forced
    k = kl(want, got)
    print(f"\n{method}: KL mean {k.mean():.3g} max {k.max():.3g}; {ties}")
    assert k.mean() < KL_MEAN[method]


def test_bench_prints_the_decode_rate(src, tmp_path_factory):
    """`ktrun bench` on the int4 conversion (int4 experts on the kernels; the other Linears bf16) prints decode and
    prefill rates and the per-token cache: 4 layers x (sliding key 32 + compressor kv/gate 2 x 64 + indexer kv/gate
    2 x 32) floats."""
    r = subprocess.run([*KTRUN, "bench", str(_conv(src, tmp_path_factory, "int4-amx")), "--pp", "32", "--tg", "16",
                        "--reps", "1"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    rate = re.search(r"\|\s+tg16\s+\|\s+([\d.]+)", r.stdout)
    assert rate and float(rate[1]) > 0, r.stdout
    print(f"\nktrun bench (int4 experts): decode {rate[1]} tokens/s")
    assert "kv_cache_per_token: 3584 bytes (4 layers with KV)" in r.stdout, r.stdout     # 4 x 224 x 4 B


def test_the_clamp_binds(src, ref, tmp_path_factory):
    """The fixture's swiglu_limit changes transformers' logits (so the tests above check a clamp that binds), and
    ktrun runs the routed experts' clamp on the kernels' KT_ACT_SILU_CLAMPED."""
    eng = Engine(_conv(src, tmp_path_factory, "bf16"), ctx=64, use_kernels=False)
    try:
        ids = eng.tokenizer.encode(PROMPT)
        act = eng.model.cfg.expert_activation
        assert (act.kind, act.limit) == ("silu_clamped", 0.5)
    finally:
        eng.close()
    with torch.no_grad():
        clamped = ref(torch.tensor([ids])).logits[0]
        for mod in ref.modules():
            if hasattr(mod, "limit"):
                mod.limit = 1e4
        try:
            free = ref(torch.tensor([ids])).logits[0]
        finally:
            for mod in ref.modules():
                if hasattr(mod, "limit"):
                    mod.limit = 0.5
    assert (clamped - free).abs().max() > 1e-2


def test_exact_indexer_ties_do_not_depend_on_the_forwards_length(tmp_path_factory):
    """With 4 indexer heads the CSA indexer's relu'd scores tie exactly at the k-th place at some queries. A query's
    picks (the lower index among ties), and so the prompt's logits, are the same whether the forward holds the
    prompt's first tokens or all of it: what a cached prefix and a chunked prefill rely on."""
    root = shared_root(tmp_path_factory) / "v4_index_heads_4"
    if not (root / "src" / "config.json").exists():
        make_checkpoint("deepseek_v4", root / "src", init_scale=INIT_SCALE, index_n_heads=4)
    eng = Engine(build_conversion(root / "src", root / "conv", "bf16"), ctx=256, use_kernels=False)
    rng = random.Random(17)
    ids = [rng.randrange(3, 300) for _ in range(37)]
    tied = []

    def count_ties(kind, scores, picks):     # queries whose k-th score is shared by a key left out
        if kind == "indexer":
            kth = scores.gather(-1, picks).amin(-1, keepdim=True)
            left_out = (scores == kth).sum(-1) > (scores.gather(-1, picks) == kth).sum(-1)
            tied.append(int((left_out & torch.isfinite(kth[:, 0])).sum()))
        return picks

    def logits(toks):
        return eng.model.forward(Batch.build([(eng.model.new_cache(256), toks)], "cpu"), all_logits=True)
    try:
        with choice_hook(count_ties):
            whole = logits(ids)
        head = logits(ids[:26])
    finally:
        eng.close()
    assert sum(tied) >= 2, tied
    torch.testing.assert_close(head, whole[:26], rtol=1e-3, atol=5e-3)
