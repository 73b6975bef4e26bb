"""The hybrid families (gated DeltaNet linear attention beside gated full attention: Qwen3-Next and Qwen3.5-MoE's
text model) in ktrun against transformers: logits of a 4-layer stack (three DeltaNet layers, one full-attention
layer) prefilled across chunk boundaries and decoded token by token, the per-request recurrent state through the
Engine (batching, n > 1 choices), KV blocks only for full-attention layers, the recurrent state planned, reported and
refused when it cannot fit, the bf16 forward, and GPTQ calibrated through transformers' own hybrid decoder layers.
Prefix reuse (from recurrent-state snapshots) is tested with every family in tests/test_runtime_prefix_cache.py. The delta rule itself is checked against
transformers in tests/test_qwen3_next.py; Qwen3.5's release layout in tests/test_qwen3_5_moe.py."""
from __future__ import annotations

import pytest
import torch
from ktrun.engine import Engine, SamplingParams
from ktrun.models.kv_cache import Batch
from runtime_helpers import (
    INIT_SCALE,
    PROMPT,
    build_conversion,
    converted,
    kl,
    reference_logits,
    shared_root,
    transformers_model,
)

from ktconvert.testing import make_checkpoint

HYBRID = ("qwen3_next", "qwen3_5_moe")
# both sides compute in float32 from identical bf16 weights (observed max |logit diff| ~4e-6 at logit scale ~7-8)
LOGIT_ATOL = 1e-4
# per family: the 4-layer stack's extra fixture options, its MoE layers, its rotary dims (partial 0.25 of head_dim 32)
STACK = {
    "qwen3_next": ({"mlp_only_layers": [1]}, (0, 2, 3)),      # layer 1 a dense MLP
    "qwen3_5_moe": ({}, (0, 1, 2, 3)),                       # Qwen3.5 has no dense-MLP layers
}


@pytest.fixture(scope="module", params=HYBRID)
def four_layers(request, tmp_path_factory):
    """Layers 0-2 DeltaNet, layer 3 full attention (full_attention_interval 4, transformers' default)."""
    name = request.param
    root = shared_root(tmp_path_factory) / f"{name}_4"
    src = make_checkpoint(name, root / "src", init_scale=INIT_SCALE, num_layers=4, full_attention_interval=4,
                          **STACK[name][0])
    return name, src, build_conversion(src, root / "conv"), transformers_model(src)


def test_four_layer_stack_matches_transformers(four_layers):
    name, _src, conv, ref = four_layers
    eng = Engine(conv, ctx=512, use_kernels=False)
    cfg = eng.model.cfg
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) and cfg.moe_layers == STACK[name][1]
    assert cfg.rope.dim == 8                                 # partial_rotary_factor 0.25 of head_dim 32
    ids = eng.tokenizer.encode(" ".join([PROMPT] * 8))
    assert len(ids) > 130                                   # three 64-token chunks, the last one partial
    want = reference_logits(ref, ids)
    cache = eng.model.new_cache(512)
    # prefill 70 tokens (two chunks), then 60 more continuing that state, then one token at a time
    parts = [ids[:70], ids[70:130]] + [[t] for t in ids[130:]]
    got = torch.cat([eng.model.forward(Batch.build([(cache, p)], "cpu"), all_logits=True) for p in parts])
    diff = (got - want).abs().max().item()
    assert diff < LOGIT_ATOL, f"max |logit diff| {diff:.3g} (logit scale {want.abs().max():.3g})"
    assert set(cache.recurrent) == {0, 1, 2}                # one state per DeltaNet layer, none for attention
    eng.close()


def _generate(eng: Engine, prompts: dict[str, list[int]], n_tokens: int, n: int = 1) -> dict:
    for k, ids in prompts.items():
        eng.add_request(k, ids, SamplingParams(max_tokens=n_tokens, ignore_eos=True, n=n))
    out: dict = {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault((o[0], o.index), []).append(o[1])
    return out


def test_engine_state_is_per_request(four_layers):
    """Requests of different lengths decoded together equal their solo runs; n=2 greedy choices (forked state)
    equal one; 32 greedy tokens are transformers' argmax (with the prefix cache on: the repeats below resume from
    its snapshots)."""
    _name, _src, conv, ref = four_layers
    eng = Engine(conv, ctx=512, max_batch=4, use_kernels=False)
    assert eng.prefix_cache is not None and eng.model.has_recurrent_state
    tok = eng.tokenizer
    prompts = {"short": tok.encode("fox"), "long": tok.encode(" ".join([PROMPT] * 3)), "mid": tok.encode(PROMPT)}
    alone = {k: _generate(eng, {k: v}, 32)[k, 0] for k, v in prompts.items()}
    together = _generate(eng, prompts, 32)
    assert {k: together[k, 0] for k in prompts} == alone
    forked = _generate(eng, {"mid": prompts["mid"]}, 16, n=2)
    assert forked["mid", 0] == forked["mid", 1] == alone["mid"][:16]
    ids = prompts["mid"] + alone["mid"]
    rows = reference_logits(ref, ids)[len(prompts["mid"]) - 1: -1]
    assert [int(r.argmax()) for r in rows] == alone["mid"]    # transformers' greedy continuation
    eng.close()


def test_continuing_without_state_is_an_error(four_layers):
    _name, _src, conv, _ref = four_layers
    eng = Engine(conv, ctx=256, use_kernels=False)
    cache = eng.model.new_cache(256)
    eng.model.forward(Batch.build([(cache, [5, 6, 7])], "cpu"))
    cache.recurrent.clear()
    with pytest.raises(RuntimeError, match="without its recurrent state"):
        eng.model.forward(Batch.build([(cache, [8])], "cpu"))
    eng.close()


def test_kv_blocks_only_for_full_attention_layers(four_layers):
    """Three DeltaNet layers + one full-attention layer: the KV pool holds one layer's k and v per position."""
    from ktrun.experts.hot import kv_bytes_per_token

    _name, _src, conv, _ref = four_layers
    eng = Engine(conv, ctx=256, use_kernels=False)
    cfg = eng.model.cfg
    assert eng.model.kv_pool.layout.num_layers == 1
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * cfg.num_kv_heads * cfg.head_dim * 4
    eng.close()


def test_recurrent_state_is_planned_reported_and_refused(four_layers):
    """The state of the 3 DeltaNet layers (conv window + S per layer) per request: in the Engine's plan (3 per
    request slot with the prefix cache: each request's, its last block end's, the cache's device snapshots), in
    recurrent_state_bytes() while a request runs, in the --gpu-mem plan, in `ktrun bench`; an Engine whose states
    cannot fit the free memory is refused with the numbers."""
    import subprocess

    from ktrun.cache_budget import CacheBudgetError, available_bytes
    from ktrun.experts.hot import dense_device_bytes, kv_bytes_per_token, resolve_placement
    from ktrun.experts.placement import Budget, HotExpertOptions, PlacementError
    from runtime_helpers import KTRUN

    _name, _src, conv, _ref = four_layers
    eng = Engine(conv, ctx=256, max_batch=2, use_kernels=False)
    cfg, la = eng.model.cfg, eng.model.cfg.linear_attention
    sb = 3 * ((la.conv_kernel - 1) * la.conv_dim * 4 + la.num_v_heads * la.k_head_dim * la.v_head_dim * 4)
    plan = eng.cache_plan
    assert plan.state_per_request == sb == eng.model.state_layout.nbytes() and plan.states == 3 * 2
    assert plan.kv_bytes == 256 * 2 * kv_bytes_per_token(cfg, torch.float32) and plan.total == plan.kv_bytes + 6 * sb
    eng.add_request("a", list(range(5, 35)), SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()
    assert eng.recurrent_state_bytes() == sb                  # 30 tokens committed: no new block end crossed
    eng.step()
    eng.step()
    assert eng.recurrent_state_bytes() == 2 * sb              # 32: + the state at that block end (kept at its end)
    eng.abort("a")
    assert eng.recurrent_state_bytes() == 0

    c = eng.converted                                         # --gpu-mem leaves room for the states as well
    dense, kv = dense_device_bytes(c), 256 * kv_bytes_per_token(cfg, c.dtype)
    opts = HotExpertOptions(budget=Budget(gpu_mem=int((dense + kv + 20 * sb) / 0.95)), strategy="uniform")
    placement, _fmt = resolve_placement(c, opts, kv_tokens=256, kv_states=4)
    assert placement.budget["plan"]["state_mem"] == 4 * sb
    with pytest.raises(PlacementError, match=r"recurrent state .*: 40 requests' linear-attention layers"):
        resolve_placement(c, opts, kv_tokens=256, kv_states=40)
    eng.close()

    huge = 2 * available_bytes("cpu") // sb                   # states alone twice the free memory
    with pytest.raises(CacheBudgetError, match=r"recurrent state .* cannot fit .* lower --max-batch or --ctx"):
        Engine(conv, ctx=16, max_batch=huge, use_kernels=False, prefix_cache=False)
    r = subprocess.run([*KTRUN, "bench", str(conv), "--pp", "8", "--tg", "2", "--reps", "1", "--reference-experts"],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"recurrent_state_per_request: {sb} bytes (3 linear-attention layers)" in r.stdout, r.stdout
    assert f"kv_cache_per_token: {kv_bytes_per_token(cfg, torch.float32)} bytes (1 layer with KV)" in r.stdout


def _prompt_logits(conv, prompt: str, dtype=torch.float32) -> torch.Tensor:
    eng = Engine(conv, ctx=256, use_kernels=False, dtype=dtype)
    ids = eng.tokenizer.encode(prompt)
    out = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    eng.close()
    return out.float()


@pytest.mark.parametrize("name", HYBRID)
def test_bfloat16_runtime_stays_close_to_float32(tmp_path_factory, name):
    """The forward in bf16 (conv, projections, norms in bf16; delta rule state in float32) against float32.
    Observed (qwen3_next): KL mean 3.2e-4, max 2.5e-2 over a 3x prompt."""
    conv = converted(tmp_path_factory, name, "bf16")
    prompt = " ".join([PROMPT] * 3)
    d = kl(_prompt_logits(conv, prompt), _prompt_logits(conv, prompt, torch.bfloat16))
    assert d.mean() < 3e-3 and d.max() < 1e-1, (d.mean(), d.max())


@pytest.mark.parametrize("name", HYBRID)
def test_gptq_calibrates_through_the_hybrid_layers(tmp_path_factory, name):
    """--gpu-method gptq-int4 calibrates layer by layer through transformers' own decoder layers (DeltaNet's input
    projections, fused in Qwen3-Next and split in Qwen3.5, its out_proj and the gated q_proj included) and beats
    round-to-nearest at the same format. Observed KL vs bf16 (int8 experts, marlin group 64): qwen3_next gptq mean
    1.2e-2 max 5.0e-2, rtn 2.0e-2 / 6.7e-2; qwen3_5_moe gptq 7.8e-3 / 5.0e-2, rtn 1.7e-2 / 7.5e-2."""
    prompt = PROMPT + " and then some more words"
    ref = _prompt_logits(converted(tmp_path_factory, name, "bf16"), prompt)
    kw = {"gpu_format": "marlin", "gpu_group_size": 64}
    gptq = kl(ref, _prompt_logits(converted(tmp_path_factory, name, "int8-amx", gpu_method="gptq-int4", **kw), prompt))
    rtn = kl(ref, _prompt_logits(converted(tmp_path_factory, name, "int8-amx", gpu_method="rtn-int4", **kw), prompt))
    assert gptq.mean() < rtn.mean() and gptq.mean() < 3e-2 and gptq.max() < 1e-1, (gptq, rtn)
