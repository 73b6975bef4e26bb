"""MiMo-V2-Flash in ktconvert and ktrun against transformers (MiMoV2FlashForCausalLM, the fixture built with it):
both config.json spellings (the release's hybrid_layer_pattern / swa_* keys and transformers 5's layer_types /
rope_parameters) read to the same model, the one transformers builds; errors naming the field; hub names and roles
(sinks as attention_sink_bias, MTP layers under model.mtp. skipped); logits of prompts many sliding windows long,
prefilled in chunks and decoded token by token, in bf16 and with int8 / int4 experts and GPU layers (transformers
running the same quantized weights, with ktrun's router choices forced where a near-tie flips one); greedy
continuations; tokenization; the KV cache's one width for both layer kinds; `ktconvert inspect` and `ktrun bench`.
(The fixture also runs through every ARCHS-parametrized test: runtime models, quantized families, conversions.)"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from discrete_choices import compare, force_transformers, record_ktrun
from ktlayouts.families import ConfigError, load_config, parse_config
from ktrun.engine import Engine, SamplingParams
from ktrun.models import arch_module
from ktrun.models.kv_cache import Batch
from ktrun.ops.library import kernels_available
from runtime_helpers import (
    KTRUN,
    PROMPT,
    build_checkpoint,
    converted,
    greedy_gaps,
    reference_logits,
    shared_root,
    transformers_model,
    transformers_tokenizer,
)
from test_family_quantized import quantized_reference_checkpoint

from ktconvert.sources import SourceError, open_source
from ktconvert.sources.roles import adapter_for

ARCH = "mimo_v2_flash"
WINDOW = 8                 # the fixture's sliding_window_size 7 + the query
KTCONVERT = [sys.executable, "-m", "ktconvert"]
# float32 on both sides from identical weights (reference experts; observed max |logit diff| 2.9e-6 at logit scale
# ~6); bf16 kernel experts round activations to bf16, int8/int4 experts quantize them per group
LOGIT_ATOL = {"reference": 1e-4, "kernels": 5e-2}
GREEDY_GAP = {"reference": 1e-3, "kernels": 1e-1}
# router choice scores (sigmoid + correction bias) within this of the row's top score; a flipped expert must be a
# near-tie the measured score difference explains (discrete_choices.TieReport.check)
SCORE_BOUND = {"reference": {"router": 1e-4}, "kernels": {"router": 1e-2}}
BACKENDS = ["reference", pytest.param("kernels", marks=pytest.mark.skipif(
    not kernels_available(), reason="libktkernels / runtime/ops/moe.py not available on this machine"))]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return build_checkpoint(shared_root(tmp_path_factory), ARCH)


@pytest.fixture(scope="module")
def ref(src):
    return transformers_model(src)


def _long_ids(eng: Engine) -> list[int]:
    ids = eng.tokenizer.encode(" ".join([PROMPT] * 4))
    assert len(ids) > 5 * WINDOW                    # many windows: the sliding layers drop most keys
    return ids


def _chunked_logits(eng: Engine, ids: list[int]) -> torch.Tensor:
    """Prefill 7 tokens, then 9 more continuing the cache (past the window), then one token at a time."""
    cache = eng.model.new_cache(256)
    parts = [ids[:7], ids[7:16]] + [[t] for t in ids[16:]]
    return torch.cat([eng.model.forward(Batch.build([(cache, p)], "cpu"), all_logits=True) for p in parts])


# --- config.json ----------------------------------------------------------------------------------------------------

def _summary(cfg) -> dict:
    sa = cfg.sliding_attention
    return {"layer_types": cfg.layer_types, "moe_layers": cfg.moe_layers, "window": cfg.sliding_window,
            "heads": (cfg.num_heads, cfg.num_kv_heads, sa.num_kv_heads, cfg.head_dim, cfg.v_head_dim),
            "rope": (cfg.rope.theta, cfg.rope.dim), "swa_rope": (sa.rope.theta, sa.rope.dim),
            "sinks": (cfg.attention_sinks, sa.sinks), "value_scale": cfg.value_scale, "eps": cfg.rms_norm_eps,
            "routing": (cfg.scoring, cfg.topk_method, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                        cfg.routed_scaling_factor, cfg.n_shared_experts)}


def test_release_and_transformers_spellings_read_as_transformers_builds(src, ref, tmp_path):
    """The fixture's config.json has the release's keys only (no layer_types / rope_parameters); transformers' own
    save has its keys; both parse to the model transformers built: kv heads, sinks and window per layer read off
    its modules."""
    release = load_config(src / "config.json")
    raw = json.loads((src / "config.json").read_text())
    assert "layer_types" not in raw and "rope_parameters" not in raw and raw["hybrid_layer_pattern"] == [0, 1, 1]
    ref.config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" in saved and "full_attention" in saved["rope_parameters"]
    hf_only = {k: v for k, v in saved.items() if not k.startswith(("swa_", "add_")) and k not in (
        "hybrid_layer_pattern", "moe_layer_freq", "rope_theta", "partial_rotary_factor", "layernorm_epsilon",
        "sliding_window_size")}
    hf_only["sliding_window"] = ref.config.sliding_window
    for cfg in (load_config(tmp_path / "config.json"), parse_config(hf_only)):
        assert _summary(cfg) == _summary(release)
    s = _summary(release)
    assert s["layer_types"] == ("full_attention", "sliding_attention", "sliding_attention")
    assert s["moe_layers"] == (1, 2) and s["window"] == WINDOW == ref.config.sliding_window
    assert s["heads"] == (4, 1, 2, 48, 32) and s["rope"] == (5e6, 16) and s["swa_rope"] == (1e4, 16)
    assert s["sinks"] == (False, True) and s["value_scale"] == 0.707
    layers = ref.model.layers
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        kv = attn.k_proj.out_features // attn.head_dim
        sliding = release.layer_types[i] == "sliding_attention"
        assert kv == (release.sliding_attention.num_kv_heads if sliding else release.num_kv_heads)
        assert (attn.sinks is not None) == sliding and attn.v_proj.out_features == kv * release.v_head_dim
        assert attn.sliding_window == (release.sliding_window if sliding else None)
        assert hasattr(layer.mlp, "experts") == (i in release.moe_layers)


def test_release_sized_config():
    """The release's numbers (48 layers, 4 / 8 kv heads, 192 / 128 head dims, window 128 + 1, rope 5e6 / 1e4 over
    64 of 192 dims, 256 experts top 8, dense first layer, FP8 block quantization): parsed as transformers' class
    reads the same file."""
    from transformers import AutoConfig
    n = 48
    pattern = [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(n)]
    raw = {"model_type": ARCH, "architectures": ["MiMoV2FlashForCausalLM"], "num_hidden_layers": n,
           "hidden_size": 4096, "intermediate_size": 16384, "moe_intermediate_size": 2048, "vocab_size": 152576,
           "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128,
           "swa_num_attention_heads": 64, "swa_num_key_value_heads": 8, "swa_head_dim": 192, "swa_v_head_dim": 128,
           "hybrid_layer_pattern": pattern, "moe_layer_freq": [0] + [1] * (n - 1), "sliding_window": 128,
           "sliding_window_size": 128, "rope_theta": 5000000, "swa_rope_theta": 10000, "partial_rotary_factor": 0.334,
           "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False, "attention_value_scale": 0.707,
           "n_routed_experts": 256, "num_experts_per_tok": 8, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
           "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": None,
           "n_shared_experts": None, "layernorm_epsilon": 1e-5, "max_position_embeddings": 262144,
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}}
    cfg = parse_config(raw)
    hf = AutoConfig.for_model(ARCH, **{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.sliding_window == hf.sliding_window == 129
    assert cfg.moe_layers == tuple(i for i, t in enumerate(hf.mlp_layer_types) if t == "sparse")
    assert (cfg.rope.theta, cfg.rope.dim, cfg.sliding_attention.rope.theta, cfg.sliding_attention.rope.dim) == \
        (5e6, 64, 1e4, 64)
    assert cfg.routed_scaling_factor == hf.routed_scaling_factor == 1.0 and cfg.n_shared_experts == 0
    # one KV width for both kinds: k (8, 192) and v (8, 128) per position and layer; the 9 full layers repeat
    # their 4 heads
    mod = arch_module(ARCH)
    assert mod.cache_widths(cfg) == [(8, 192), (8, 128)]
    assert cfg.layer_types.count("full_attention") == 9


@pytest.mark.parametrize("change, field", [
    ({"num_experts_per_tok": None}, "'num_experts_per_tok'"),
    ({"hybrid_layer_pattern": [0, 1]}, "field 'hybrid_layer_pattern' must list one 0/1 per layer"),
    ({"hybrid_layer_pattern": [0, 2, 1]}, r"field 'hybrid_layer_pattern'\[1\] = 2 is not 0 or 1"),
    ({"layer_types": ["full_attention", "full_attention", "sliding_attention"]},
     "field 'layer_types' = .* disagrees with 'hybrid_layer_pattern'"),
    ({"layer_types": ["full_attention", "chunked_attention", "sliding_attention"], "hybrid_layer_pattern": None},
     r"field 'layer_types'\[1\] = 'chunked_attention' is not one of"),
    ({"moe_layer_freq": [0, 1]}, "field 'moe_layer_freq' must list one 0/1 per layer"),
    ({"swa_num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of swa_num_key_value_heads=3"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"swa_head_dim": 64}, "field 'swa_head_dim' = 64 differs from 'head_dim' = 48"),
    ({"swa_v_head_dim": 48}, "field 'swa_v_head_dim' = 48 differs from 'v_head_dim' = 32"),
    ({"swa_num_attention_heads": 8}, "field 'swa_num_attention_heads' = 8 differs"),
    ({"sliding_window_size": -1}, "field 'sliding_window_size' = -1 must be >= 0"),
    ({"sliding_window_size": None, "sliding_window": 0}, "field 'sliding_window' = 0 must be >= 1"),
    ({"partial_rotary_factor": 1.5}, "'partial_rotary_factor' = 1.5"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}, "sliding_attention": {}}},
     "rope type 'yarn' of the full_attention layers is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}}}, "'rope_parameters' has no 'sliding_attention'"),
    ({"scoring_func": "softmax"}, "field 'scoring_func' = 'softmax' is not 'sigmoid'"),
    ({"topk_method": "greedy"}, "field 'topk_method' = 'greedy' is not 'noaux_tc'"),
    ({"n_shared_experts": 1}, "field 'n_shared_experts' = 1"),
    ({"n_group": 3}, "n_routed_experts=16 is not a multiple of n_group=3"),
    ({"head_dim": "48"}, "'head_dim'"),
])
def test_config_errors_name_the_field(src, change, field):
    raw = {**json.loads((src / "config.json").read_text()), **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=field):
        parse_config(raw)
    with pytest.raises(SourceError, match=field):     # the converter, before any weight is read
        adapter_for(raw)


# --- hub names ------------------------------------------------------------------------------------------------------

def test_hub_names_and_roles(src):
    with open_source(src) as s:
        a = s.arch
        roles = {n: a.classify(n) for n in s.tensor_names()}
        assert roles["model.layers.1.self_attn.attention_sink_bias"].kind == "attention"
        assert "model.layers.0.self_attn.attention_sink_bias" not in roles          # no sinks on full layers
        assert roles["model.layers.0.mlp.gate_proj.weight"].kind == "dense_mlp"
        assert roles["model.layers.1.mlp.gate.weight"].kind == "router"
        assert roles["model.layers.2.mlp.gate.e_score_correction_bias"].kind == "router_bias"
        e = roles["model.layers.2.mlp.experts.15.down_proj.weight"]
        assert (e.kind, e.layer, e.expert, e.proj) == ("expert", 2, 15, "down")
        assert s.info("model.layers.1.self_attn.v_proj.weight").shape == (2 * 32, 96)       # 2 kv heads x v dims
        assert s.info("model.layers.0.self_attn.k_proj.weight").shape == (1 * 48, 96)       # 1 kv head x q/k dims
        for name in ("model.mtp.layers.0.eh_proj.weight", "model.mtp.layers.0.self_attn.q_proj.weight",
                     "model.mtp.layers.2.enorm.weight"):
            role = a.classify(name)
            assert role.kind == "skip" and "multi-token-prediction" in role.reason, name


def test_mtp_layers_are_skipped_by_the_converter_and_transformers(src, ref, tmp_path):
    """A copy of the fixture with the release's MTP tensors (model.mtp.layers.N...) in a shard of their own: the
    conversion skips them and says so; transformers ignores them too (its _keys_to_ignore_on_load_unexpected)."""
    from safetensors.torch import save_file
    d = tmp_path / "with_mtp"
    shutil.copytree(src, d)
    h = 96
    mtp = {"model.mtp.layers.0.enorm.weight": torch.ones(h), "model.mtp.layers.0.hnorm.weight": torch.ones(h),
           "model.mtp.layers.0.eh_proj.weight": torch.randn(h, 2 * h),
           "model.mtp.layers.0.self_attn.q_proj.weight": torch.randn(4 * 48, h)}
    save_file({k: v.to(torch.bfloat16) for k, v in mtp.items()}, str(d / "mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    r = subprocess.run([*KTCONVERT, "quantize", str(d), "--method", "bf16", "-o", str(tmp_path / "conv")],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert f"skipped {len(mtp)} tensors: multi-token-prediction layer" in r.stderr, r.stderr
    ids = list(range(3, 30))
    assert torch.equal(reference_logits(transformers_model(d), ids), reference_logits(ref, ids))


# --- the forward ----------------------------------------------------------------------------------------------------

def test_kv_cache_holds_both_kinds_in_one_width(tmp_path_factory):
    eng = Engine(converted(tmp_path_factory, ARCH, "bf16"), ctx=256, use_kernels=False)
    try:
        cfg = eng.model.cfg
        layout = eng.model.cache_layout()
        # k (2 heads, 48) and v (2 heads, 32): the sliding layers' 2 kv heads; the full layer repeats its 1
        assert layout.token_shapes == ((2, 48), (2, 32)) and layout.num_layers == cfg.num_layers == 3
        cache = eng.model.new_cache(64)
        ids = eng.tokenizer.encode(PROMPT)
        eng.model.forward(Batch.build([(cache, ids)], "cpu"))
        k0 = eng.model.kv_pool.tokens[0][0, cache.blocks[0], :len(ids)]       # layer 0 (full): (n, 2, 48)
        assert torch.equal(k0[:, 0], k0[:, 1])
        k1 = eng.model.kv_pool.tokens[0][1, cache.blocks[0], :len(ids)]       # layer 1 (sliding): 2 heads
        assert not torch.equal(k1[:, 0], k1[:, 1])
        assert eng.prefix_cache is not None       # every position stays cached: the prefix cache serves it
    finally:
        eng.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_prompt_chunked_prefill_and_decode_match_transformers(tmp_path_factory, ref, backend):
    eng = Engine(converted(tmp_path_factory, ARCH, "bf16"), ctx=256, use_kernels=backend == "kernels")
    try:
        ids = _long_ids(eng)
        want = reference_logits(ref, ids)
        got = _chunked_logits(eng, ids)
    finally:
        eng.close()
    diff = (got - want).abs().max().item()
    print(f"bf16 {backend}: {len(ids)} tokens (window {WINDOW}), max |logit diff| {diff:.3g} "
          f"(logit scale {want.abs().max():.3g})")
    assert diff < LOGIT_ATOL[backend], f"max |logit diff| {diff:.3g}"


def test_window_sinks_value_scale_and_swa_rope_each_matter(src, ref):
    """The comparison above sees each MiMo detail: the reference moves when any one of them is changed."""
    ids = list(range(3, 3 + 5 * WINDOW))
    base = reference_logits(ref, ids)
    changes = {
        "window": lambda m: [setattr(l.self_attn, "sliding_window", None) for l in m.model.layers],
        "sinks": lambda m: [l.self_attn.sinks.data.fill_(-1e4) for l in m.model.layers
                            if l.self_attn.sinks is not None],
        "value_scale": lambda m: [setattr(l.self_attn, "v_scale", 1.0) for l in m.model.layers],
        "swa_rope": lambda m: m.model.rotary_emb.sliding_attention_inv_freq.copy_(
            m.model.rotary_emb.full_attention_inv_freq),
    }
    for what, change in changes.items():
        m = transformers_model(src)
        with torch.no_grad():
            change(m)
        if what == "window":      # the mask comes from the config
            m.config.sliding_window = 10 ** 6
        moved = (reference_logits(m, ids) - base).abs().max().item()
        assert moved > 1e-2, f"{what}: the logits moved only {moved:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_32_tokens_past_the_window_are_transformers_argmax(tmp_path_factory, ref, backend):
    eng = Engine(converted(tmp_path_factory, ARCH, "bf16"), ctx=256, use_kernels=backend == "kernels")
    try:
        ids = eng.tokenizer.encode(PROMPT + " " + PROMPT)
        eng.add_request("a", ids, SamplingParams(max_tokens=32, ignore_eos=True))
        gen = []
        while eng.has_work():
            gen += [t for _r, t, _f in eng.step()]
    finally:
        eng.close()
    assert len(gen) == 32
    gaps = greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)
    print(f"bf16 {backend}: greedy gap max {max(gaps):.3g}")
    assert max(gaps) <= GREEDY_GAP[backend], gaps


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method, gpu_method", [("int8-amx", "rtn-int8"), ("int4-amx", "rtn-int4")])
def test_quantized_long_prompt_and_greedy_match_transformers_on_the_same_weights(tmp_path_factory, src, method,
                                                                                   gpu_method, backend):
    """int8 / int4 experts and GPU layers: transformers runs the converted (dequantized) weights; the long prompt in
    chunks then token by token, and a 32-token greedy continuation, with ktrun's router choices forced on
    transformers; every expert where the two chose differently must be a near-tie (the count is printed)."""
    conv = converted(tmp_path_factory, ARCH, method, gpu_method=gpu_method)
    qref = transformers_model(quantized_reference_checkpoint(
        src, conv, shared_root(tmp_path_factory) / f"qref_{ARCH}_{method}_{gpu_method}"))
    eng = Engine(conv, ctx=256, use_kernels=backend == "kernels", gpu_weights="dequant")
    try:
        cfg, ids = eng.model.cfg, _long_ids(eng)
        with record_ktrun(cfg) as log:
            got = _chunked_logits(eng, ids)
        gen_ids = eng.tokenizer.encode(PROMPT + " " + PROMPT)
        with record_ktrun(cfg) as gen_log:
            eng.add_request("g", gen_ids, SamplingParams(max_tokens=32, ignore_eos=True))
            gen = []
            while eng.has_work():
                gen += [t for _r, t, _f in eng.step()]
    finally:
        eng.close()
    with force_transformers(qref, cfg, log) as own:
        want = reference_logits(qref, ids)
    ties = compare(log, own)
    diff = (got - want).abs().max().item()
    with force_transformers(qref, cfg, gen_log) as gen_own:
        gaps = greedy_gaps(reference_logits(qref, gen_ids + gen), len(gen_ids), gen)
    gen_ties = compare(gen_log, gen_own)
    print(f"{method}+{gpu_method} {backend}: {len(ids)} tokens, max |logit diff| {diff:.3g} (logit scale "
          f"{want.abs().max():.3g}); prompt {ties}; continuation {gen_ties}; greedy gap max {max(gaps):.3g}")
    ties.check(SCORE_BOUND[backend])
    gen_ties.check(SCORE_BOUND[backend])
    assert diff < LOGIT_ATOL[backend]
    assert len(gen) == 32 and max(gaps) <= GREEDY_GAP[backend], gaps


def _dequantized_fp8(src, out):
    """The FP8 release's weights dequantized here, independently of ktconvert's reader: each e4m3 value times its
    128 x 128 block's weight_scale_inv (partial blocks at the edges), rounded to bf16; a plain hub checkpoint."""
    from safetensors.torch import load_file, save_file
    stored = {}
    for shard in sorted(src.glob("*.safetensors")):
        stored.update(load_file(str(shard)))
    tensors = {}
    for n, t in stored.items():
        if n.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = stored[n + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            t = (t.float() * s[:t.shape[0], :t.shape[1]]).to(torch.bfloat16)
        tensors[n] = t
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_fp8_release_converts_and_runs_as_its_dequantized_weights(tmp_path_factory, tmp_path):
    """The release's format: FP8 e4m3 attention projections, dense MLP and experts with 128 x 128 block scales
    (weight_scale_inv; the fixture's dims are partial blocks), read by the FP8 reader; ktrun's logits of the long
    prompt (chunked, then token by token) equal transformers' on the dequantized weights."""
    src = build_checkpoint(shared_root(tmp_path_factory), ARCH, fp8=True)
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["weight_block_size"]) == ("fp8", [128, 128])
    with open_source(src) as s:
        fp8 = {n for n in s.tensor_names() if s.info(n).dtype == "F8_E4M3"}
    assert {"model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
            "model.layers.2.mlp.experts.3.down_proj.weight"} <= fp8
    assert "model.layers.1.self_attn.attention_sink_bias" not in fp8 and "model.layers.1.mlp.gate.weight" not in fp8
    ref = transformers_model(_dequantized_fp8(src, tmp_path / "deq"))
    eng = Engine(converted(tmp_path_factory, ARCH, "bf16", fp8=True), ctx=256, use_kernels=False)
    try:
        ids = _long_ids(eng)
        got = _chunked_logits(eng, ids)
    finally:
        eng.close()
    want = reference_logits(ref, ids)
    diff = (got - want).abs().max().item()
    print(f"fp8 -> bf16 reference: max |logit diff| {diff:.3g}")
    assert diff < LOGIT_ATOL["reference"]


def test_tokenization_matches_transformers(tmp_path_factory, src):
    hf_tok = transformers_tokenizer(src)
    eng = Engine(converted(tmp_path_factory, ARCH, "bf16"), ctx=256, use_kernels=False)
    try:
        for text in (PROMPT, " ".join([PROMPT] * 4), "  spaces\nand\ttabs", "ünïcødé ✓ 123", ""):
            assert eng.tokenizer.encode(text) == hf_tok(text).input_ids, text
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
        want = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert eng.tokenizer.apply_chat_template(msgs) == list(want)
    finally:
        eng.close()


# --- the commands ---------------------------------------------------------------------------------------------------

def test_pull_selects_the_release_files_without_remote_code():
    """The release's repo (remote-code modeling / configuration files beside the weights, whose shards also hold the
    MTP layers): `ktconvert pull` takes weights, index, configs and tokenizer files, never the .py files."""
    from ktconvert.hub.plan import select_files
    shards = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    repo = shards + ["model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "vocab.json", "merges.txt", "configuration_mimo_v2_flash.py",
                     "modeling_mimo_v2_flash.py", "README.md", "LICENSE", "figures/overview.png"]
    chosen, skipped = select_files(sorted(repo), None, None)
    assert sorted(chosen) == sorted(shards + ["model.safetensors.index.json", "config.json",
                                              "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                              "vocab.json", "merges.txt"]) and not skipped


def test_inspect_reports_parameters_by_role(src):
    r = subprocess.run([*KTCONVERT, "inspect", str(src), "--gpu-mem", "1GB", "--cpu-mem", "1GB"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "architecture: mimo_v2_flash, 3 layers, 2 MoE layers, 16 routed experts (top 4)" in r.stdout
    with open_source(src) as s:
        by_role: dict[str, int] = {}
        for n in s.tensor_names():
            kind = s.arch.classify(n).kind
            by_role[kind] = by_role.get(kind, 0) + int(torch.Size(s.info(n).shape).numel())
    assert set(by_role) == {"expert", "attention", "dense_mlp", "head", "embedding", "router", "norm",
                            "router_bias"}
    for kind, n in by_role.items():
        assert f"  {kind:<14} {n:>16,d}" in r.stdout, (kind, r.stdout)
    assert "GPU fits" in r.stdout and "CPU fits" in r.stdout


def test_ktrun_bench_prints_the_decode_rate(tmp_path_factory):
    """On the CPU kernels (int4 experts, quantized GPU Linears on the kernels' Linear op: no float copy)."""
    conv = converted(tmp_path_factory, ARCH, "int4-amx", gpu_method="rtn-int4")
    args = [] if kernels_available() else ["--reference-experts"]
    r = subprocess.run([*KTRUN, "bench", str(conv), "--pp", "16", "--tg", "32", "--reps", "1", *args],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    rate = re.search(r"\|\s+tg32 \|\s+([\d.]+)", r.stdout)
    assert rate and float(rate[1]) > 0, r.stdout
    print(f"ktrun bench (int4 experts + rtn-int4 GPU layers): decode {rate[1]} tokens/s")
    assert "kv_cache_per_token: 1920 bytes (3 layers with KV)" in r.stdout    # 3 x 4 B x 2 heads x (48 + 32)
