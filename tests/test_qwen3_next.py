"""Qwen3-Next (hybrid gated DeltaNet + gated full attention) in ktrun against transformers: the delta rule (chunked
and recurrent) against transformers' torch implementations, logits of a 4-layer stack (three DeltaNet layers, one
full-attention layer, a dense-MLP layer) prefilled across chunk boundaries and decoded token by token, and the
per-request recurrent state through the Engine (batching, n > 1 choices, no prefix reuse)."""
from __future__ import annotations

import pytest
import torch
from ktrun.engine import Engine, SamplingParams
from ktrun.models.kv_cache import Batch
from ktrun.models.linear_attention import delta_rule_chunked, delta_rule_recurrent, l2_normalize
from runtime_helpers import INIT_SCALE, PROMPT, build_conversion, reference_logits, shared_root, transformers_model

from ktconvert.testing import make_checkpoint

# both sides compute in float32 from identical bf16 weights (observed max |logit diff| ~4e-6 at logit scale ~7)
LOGIT_ATOL = 1e-4
DELTA_ATOL = 1e-4   # float32 delta rule, chunked vs per-token orders of summation (observed ~1e-6)


def _inputs(L: int, h: int = 4, dk: int = 16, dv: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(L, h, dk, generator=gen), torch.randn(L, h, dk, generator=gen)
    v = torch.randn(L, h, dv, generator=gen)
    g = -torch.rand(L, h, generator=gen) * 0.5             # log decay <= 0
    beta = torch.rand(L, h, generator=gen)
    s0 = torch.randn(h, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("L, chunk", [(1, 64), (5, 64), (64, 64), (100, 32), (37, 8)])
def test_delta_rule_matches_transformers(L, chunk):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )
    q, k, v, g, beta, s0 = _inputs(L)
    # transformers: (B, L, h, d) raw q/k, L2-normalized and scaled inside
    want_o, want_s = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=
                                                      s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_c, want_cs = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], chunk_size=chunk,
                                                   initial_state=s0[None], output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    qn, kn = l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)
    for o, s in (delta_rule_recurrent(qn, kn, v, g, beta, s0), delta_rule_chunked(qn, kn, v, g, beta, s0, chunk)):
        for a, b in ((o, want_o[0]), (s, want_s[0]), (o, want_c[0]), (s, want_cs[0])):
            assert (a - b).abs().max() < DELTA_ATOL


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """Layers 0-2 DeltaNet, layer 3 full attention (the default full_attention_interval 4); layer 1 a dense MLP."""
    root = shared_root(tmp_path_factory) / "qwen3_next_4"
    src = make_checkpoint("qwen3_next", root / "src", init_scale=INIT_SCALE, num_layers=4, full_attention_interval=4,
                          mlp_only_layers=[1])
    return src, build_conversion(src, root / "conv"), transformers_model(src)


def test_four_layer_stack_matches_transformers(four_layers):
    _src, conv, ref = four_layers
    eng = Engine(conv, ctx=512, use_kernels=False)
    cfg = eng.model.cfg
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) and cfg.moe_layers == (0, 2, 3)
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
    equal one; a prompt extending a finished one is prefilled in full (no prefix reuse: no state to resume)."""
    _src, conv, ref = four_layers
    eng = Engine(conv, ctx=512, max_batch=4, use_kernels=False)
    assert eng.prefix_cache is None and eng.model.has_recurrent_state
    tok = eng.tokenizer
    prompts = {"short": tok.encode("fox"), "long": tok.encode(" ".join([PROMPT] * 3)), "mid": tok.encode(PROMPT)}
    alone = {k: _generate(eng, {k: v}, 16)[k, 0] for k, v in prompts.items()}
    together = _generate(eng, prompts, 16)
    assert {k: together[k, 0] for k in prompts} == alone
    forked = _generate(eng, {"mid": prompts["mid"]}, 16, n=2)
    assert forked["mid", 0] == forked["mid", 1] == alone["mid"]
    ids = prompts["mid"] + alone["mid"]
    rows = reference_logits(ref, ids)[len(prompts["mid"]) - 1: -1]
    assert [int(r.argmax()) for r in rows] == alone["mid"]    # transformers' greedy continuation
    eng.close()


def test_continuing_without_state_is_an_error(four_layers):
    _src, conv, _ref = four_layers
    eng = Engine(conv, ctx=256, use_kernels=False)
    cache = eng.model.new_cache(256)
    eng.model.forward(Batch.build([(cache, [5, 6, 7])], "cpu"))
    cache.recurrent.clear()
    with pytest.raises(RuntimeError, match="without its recurrent state"):
        eng.model.forward(Batch.build([(cache, [8])], "cpu"))
    eng.close()


def test_gptq_calibrates_through_the_hybrid_layers(tmp_path_factory):
    """--gpu-method gptq-int4 calibrates layer by layer through transformers' Qwen3-Next decoder layers (DeltaNet's
    in_proj_qkvz / in_proj_ba / out_proj and the gated q_proj included) and beats round-to-nearest at the same
    format. Observed KL vs bf16 (int8 experts, marlin group 64): gptq mean 1.2e-2 max 5.0e-2, rtn 2.0e-2 / 6.7e-2."""
    from runtime_helpers import converted, kl

    def logits(conv):
        eng = Engine(conv, ctx=256, use_kernels=False)
        ids = eng.tokenizer.encode(PROMPT + " and then some more words")
        out = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
        eng.close()
        return out

    ref = logits(converted(tmp_path_factory, "qwen3_next", "bf16"))
    kw = {"gpu_format": "marlin", "gpu_group_size": 64}
    gptq = kl(ref, logits(converted(tmp_path_factory, "qwen3_next", "int8-amx", gpu_method="gptq-int4", **kw)))
    rtn = kl(ref, logits(converted(tmp_path_factory, "qwen3_next", "int8-amx", gpu_method="rtn-int4", **kw)))
    assert gptq.mean() < rtn.mean() and gptq.mean() < 3e-2 and gptq.max() < 1e-1, (gptq, rtn)


def test_bfloat16_runtime_stays_close_to_float32(tmp_path_factory):
    """The forward in bf16 (conv, projections, norms in bf16; delta rule state in float32) against float32.
    Observed: KL mean 3.2e-4, max 2.5e-2 over a 3x prompt."""
    from runtime_helpers import converted, kl

    conv = converted(tmp_path_factory, "qwen3_next", "bf16")

    def logits(dtype):
        eng = Engine(conv, ctx=256, use_kernels=False, dtype=dtype)
        ids = eng.tokenizer.encode(" ".join([PROMPT] * 3))
        out = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
        eng.close()
        return out.float()

    d = kl(logits(torch.float32), logits(torch.bfloat16))
    assert d.mean() < 3e-3 and d.max() < 1e-1, (d.mean(), d.max())


def test_kv_blocks_only_for_full_attention_layers(four_layers):
    """Three DeltaNet layers + one full-attention layer: the KV pool holds one layer's k and v per position."""
    from ktrun.hot_experts import kv_bytes_per_token

    _src, conv, _ref = four_layers
    eng = Engine(conv, ctx=256, use_kernels=False)
    cfg = eng.model.cfg
    assert eng.model.kv_pool.layout.num_layers == 1
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * cfg.num_kv_heads * cfg.head_dim * 4
    eng.close()
