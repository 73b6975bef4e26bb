"""Qwen3.5-MoE (Qwen3-Next's hybrid text model with unfused DeltaNet projections, wrapped with a vision tower) in
ktrun against transformers' Qwen3_5MoeForConditionalGeneration: the release's layout converts (text_config nesting,
model.language_model. names, the vision tower skipped), logits of a 4-layer stack (three DeltaNet layers, one
full-attention layer) prefilled across chunk boundaries and decoded token by token, and the per-request recurrent
state through the Engine (batching, n > 1 choices, no prefix reuse). The delta rule itself is shared with Qwen3-Next
(tests/test_qwen3_next.py checks it against transformers)."""
from __future__ import annotations

import json

import pytest
import torch
from ktrun.engine import Engine, SamplingParams
from ktrun.models.kv_cache import Batch
from runtime_helpers import INIT_SCALE, PROMPT, build_conversion, reference_logits, shared_root, transformers_model

from ktconvert.sources import open_source
from ktconvert.testing import make_checkpoint

# both sides compute in float32 from identical bf16 weights (observed max |logit diff| ~4e-6 at logit scale ~8)
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """Layers 0-2 DeltaNet, layer 3 full attention (full_attention_interval 4, transformers' default)."""
    root = shared_root(tmp_path_factory) / "qwen3_5_moe_4"
    src = make_checkpoint("qwen3_5_moe", root / "src", init_scale=INIT_SCALE, num_layers=4,
                          full_attention_interval=4)
    return src, build_conversion(src, root / "conv"), transformers_model(src)


def test_release_layout_is_read(four_layers):
    """config.json nests the text model under text_config (rope_parameters with an M-RoPE section); tensors sit
    under model.language_model., the vision tower under model.visual. is skipped, nothing else is."""
    src, _conv, _ref = four_layers
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["text_config"]["rope_parameters"]["mrope_section"]
    s = open_source(src)
    roles = {n: s.arch.classify(n) for n in s.tensor_names()}
    skipped = {n for n, r in roles.items() if r.kind == "skip"}
    assert skipped and all(n.startswith("model.visual.") for n in skipped)
    assert roles["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"].kind == "attention"
    assert roles["model.language_model.layers.3.mlp.experts.7.down_proj.weight"].kind == "expert"
    assert roles["lm_head.weight"].kind == "head"
    assert s.arch.moe_layers() == [0, 1, 2, 3]


def test_four_layer_stack_matches_transformers(four_layers):
    _src, conv, ref = four_layers
    eng = Engine(conv, ctx=512, use_kernels=False)
    cfg = eng.model.cfg
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) and cfg.moe_layers == (0, 1, 2, 3)
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
    equal one; 32 greedy tokens are transformers' argmax; the prefix cache is off (no state to resume)."""
    _src, conv, ref = four_layers
    eng = Engine(conv, ctx=512, max_batch=4, use_kernels=False)
    assert eng.prefix_cache is None and eng.model.has_recurrent_state
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
    _src, conv, _ref = four_layers
    eng = Engine(conv, ctx=256, use_kernels=False)
    cache = eng.model.new_cache(256)
    eng.model.forward(Batch.build([(cache, [5, 6, 7])], "cpu"))
    cache.recurrent.clear()
    with pytest.raises(RuntimeError, match="without its recurrent state"):
        eng.model.forward(Batch.build([(cache, [8])], "cpu"))
    eng.close()


def test_kv_blocks_only_for_full_attention_layers(four_layers):
    from ktrun.hot_experts import kv_bytes_per_token

    _src, conv, _ref = four_layers
    eng = Engine(conv, ctx=256, use_kernels=False)
    cfg = eng.model.cfg
    assert eng.model.kv_pool.layout.num_layers == 1
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * cfg.num_kv_heads * cfg.head_dim * 4
    eng.close()


def test_bfloat16_runtime_stays_close_to_float32(tmp_path_factory):
    """The forward in bf16 (delta rule state in float32) against float32, over a 3x prompt."""
    from runtime_helpers import converted, kl

    conv = converted(tmp_path_factory, "qwen3_5_moe", "bf16")

    def logits(dtype):
        eng = Engine(conv, ctx=256, use_kernels=False, dtype=dtype)
        ids = eng.tokenizer.encode(" ".join([PROMPT] * 3))
        out = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
        eng.close()
        return out.float()

    d = kl(logits(torch.float32), logits(torch.bfloat16))
    assert d.mean() < 3e-3 and d.max() < 1e-1, (d.mean(), d.max())


def test_gptq_calibrates_through_the_hybrid_layers(tmp_path_factory):
    """--gpu-method gptq-int4 calibrates layer by layer through transformers' Qwen3.5-MoE decoder layers (built from
    text_config; DeltaNet's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj and the gated q_proj
    included) and beats round-to-nearest at the same format. Observed KL vs bf16 (int8 experts, marlin group 64):
    gptq mean 7.8e-3 max 5.0e-2, rtn mean 1.7e-2 max 7.5e-2."""
    from runtime_helpers import converted, kl

    def logits(conv):
        eng = Engine(conv, ctx=256, use_kernels=False)
        ids = eng.tokenizer.encode(PROMPT + " and then some more words")
        out = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
        eng.close()
        return out

    ref = logits(converted(tmp_path_factory, "qwen3_5_moe", "bf16"))
    kw = {"gpu_format": "marlin", "gpu_group_size": 64}
    gptq = kl(ref, logits(converted(tmp_path_factory, "qwen3_5_moe", "int8-amx", gpu_method="gptq-int4", **kw)))
    rtn = kl(ref, logits(converted(tmp_path_factory, "qwen3_5_moe", "int8-amx", gpu_method="rtn-int4", **kw)))
    print(f"qwen3_5_moe KL vs bf16: gptq mean {gptq.mean():.3g} max {gptq.max():.3g}, "
          f"rtn mean {rtn.mean():.3g} max {rtn.max():.3g}")
    assert gptq.mean() < rtn.mean() and gptq.mean() < 3e-2 and gptq.max() < 1e-1, (gptq, rtn)
