"""Kimi Linear (KDA + NoPE MLA hybrid) in ktconvert and ktrun against transformers' KimiLinearForCausalLM: Kimi Delta
Attention against transformers' torch KDA (its fallback when the `fla` package is absent: the reference here); the
release's config.json fields and tensor names; config errors naming the field; the fixture (KDA, KDA, MLA, KDA; a
dense first layer; 192 KDA channels and 80-wide experts, neither a multiple of 128) converted in bf16, int8 and int4,
prefilled in chunks across KDA chunk boundaries and decoded token by token (the recurrent state carried) within stated
bounds of transformers; greedy continuations; Kimi's tiktoken tokenization; `ktconvert inspect`, `ktconvert pull`'s
file selection and `ktrun bench`. (The bf16 fixture also runs through every ARCHS-parametrized test: runtime models,
tokenization, prefix cache, quantized conversions.)"""
from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import torch
from discrete_choices import compare, force_transformers, record_ktrun
from ktlayouts.families import ConfigError, parse_config
from ktrun.engine import Engine, SamplingParams
from ktrun.models.kda import kda_chunked, kda_recurrent
from ktrun.models.kv_cache import Batch
from ktrun.models.linear_attention import l2_normalize
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

from ktconvert.sources import open_source

ARCH = "kimi_linear"
KDA_ATOL = 1e-5     # float32 KDA, chunked vs per-token orders of summation (observed <= 7e-7)
# bf16 conversion, 215-token prompt. Reference experts: float32 on both sides from identical bf16 weights (observed
# max |logit diff| 3.7e-6 at logit scale 6.7). Kernel experts round activations to bf16 (observed 1.0e-2). Greedy:
# every token transformers' argmax (gap 0) on both.
LOGIT_ATOL = {"reference": 1e-4, "kernels": 3e-2}
GREEDY_GAP = {"reference": 1e-3, "kernels": 3e-2}
# int8 / int4 experts + rtn-int8 / rtn-int4 GPU Linears against transformers on the same dequantized weights, with
# ktrun's router choices forced on it (tests/discrete_choices.py): the kernels' int8 activations add their rounding.
# Observed (2 threads, AVX2) over the 215 positions of the long prompt: max |logit diff| 4.4e-2 (int8) / 4.3e-2
# (int4) at logit scale 6.7, router scores within 1.0e-3 of the row's top score, one group near-tie (margin 2.8e-4)
# met with int4, none with int8.
QUANT_LOGIT_ATOL, QUANT_SCORE_BOUND = 8e-2, {"router": 1e-2, "router_group": 1e-2}
BACKENDS = ["reference", pytest.param("kernels", marks=pytest.mark.skipif(
    not kernels_available(), reason="libktkernels / runtime/ops/moe.py not available on this machine"))]

# the release's config.json (moonshotai/Kimi-Linear-48B-A3B-Instruct), the fields this family reads
RELEASE = {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": 163840,
    "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "num_expert_group": 1, "topk_group": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
    "model_max_length": 1048576, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163586,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}}


# --- the KDA rule --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L, chunk", [(1, 32), (5, 32), (64, 32), (100, 32), (37, 8)])
def test_kda_matches_transformers(L, chunk):
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )
    gen = torch.Generator().manual_seed(L)
    h, dk = 3, 16
    q, k, v = (torch.randn(L, h, dk, generator=gen) for _ in range(3))
    g = -torch.rand(L, h, dk, generator=gen) * 3.0          # per-channel log decays, some strong
    beta = torch.rand(L, h, generator=gen)
    s0 = torch.randn(h, dk, dk, generator=gen) * 0.3
    kw = {"initial_state": s0[None], "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    want_o, want_s = recurrent_kimi_delta_attention(q[None], k[None], v[None], g=g[None], beta=beta[None], **kw)
    chunk_o, chunk_s = chunk_kimi_delta_attention(q[None], k[None], v[None], g=g[None], beta=beta[None], **kw)
    qn, kn = l2_normalize(q) * dk ** -0.5, l2_normalize(k)
    for o, s in (kda_recurrent(qn, kn, v, g, beta, s0), kda_chunked(qn, kn, v, g, beta, s0, chunk),
                 kda_chunked(qn, kn, v, g, beta, s0, chunk, position=5)):
        for a, b in ((o, want_o[0]), (s, want_s[0]), (o, chunk_o[0]), (s, chunk_s[0])):
            assert (a - b).abs().max() < KDA_ATOL


# --- config.json and tensor names ----------------------------------------------------------------------------------

def test_release_config_is_read():
    cfg = parse_config(RELEASE)
    full = {3, 7, 11, 15, 19, 23, 26}
    assert cfg.layer_types == tuple("full_attention" if i in full else "linear_attention" for i in range(27))
    assert cfg.moe_layers == tuple(range(1, 27))              # first_k_dense_replace 1
    la = cfg.linear_attention
    assert (la.num_v_heads, la.k_head_dim, la.v_head_dim, la.conv_kernel, la.conv_dim) == (32, 128, 128, 4, 3 * 4096)
    assert cfg.is_mla and cfg.q_lora_rank is None and cfg.kv_lora_rank == 512
    assert cfg.softmax_scale == 192 ** -0.5                   # NoPE MLA: no YaRN mscale
    assert (cfg.scoring, cfg.n_group, cfg.topk_group, cfg.top_k, cfg.n_shared_experts) == ("sigmoid", 1, 1, 8, 1)
    assert cfg.norm_topk_prob and cfg.routed_scaling_factor == 2.446 and cfg.max_position == 1048576
    assert cfg.rms_norm_eps == 1e-5 and cfg.eos_token_ids == (163586,)


def test_transformers_spelling_reads_as_the_hub_spelling():
    """transformers 5's to_dict() (num_experts_per_token, layer_types, mlp_layer_types, linear_num_heads ...) and the
    hub's config.json give the same config; so does transformers' own reading of the hub's fields."""
    from transformers import AutoConfig
    raw = {k: v for k, v in RELEASE.items() if k not in ("architectures",)}
    hf = AutoConfig.for_model(**raw)
    assert tuple(hf.layer_types) == parse_config(RELEASE).layer_types
    d = hf.to_dict()
    d.pop("linear_attn_config")
    d.pop("first_k_dense_replace")
    ours, theirs = parse_config(RELEASE), parse_config(d)
    for f in ("layer_types", "moe_layers", "linear_attention", "top_k", "n_group", "topk_group", "norm_topk_prob",
              "routed_scaling_factor", "n_shared_experts", "max_position", "q_lora_rank", "kv_lora_rank"):
        assert getattr(ours, f) == getattr(theirs, f), f


def _bad(change: dict) -> dict:
    raw = copy.deepcopy(RELEASE)
    for k, v in change.items():
        if k.startswith("linear_attn_config."):
            raw["linear_attn_config"][k.split(".", 1)[1]] = v
        elif v is None:
            raw.pop(k)
        else:
            raw[k] = v
    return raw


@pytest.mark.parametrize("change, field", [
    ({"num_experts": None}, "'num_experts'"),
    ({"num_experts_per_token": None}, "'num_experts_per_token'"),
    ({"num_experts_per_token": 300}, "num_experts_per_tok=300"),
    ({"num_expert_group": 3}, "num_expert_group=3"),
    ({"kv_lora_rank": None}, "'kv_lora_rank'"),
    ({"linear_attn_config.kda_layers": [1, 2, 3]}, "are in neither kda_layers nor full_attn_layers"),
    ({"linear_attn_config.kda_layers": [1, 2, 3, 4]}, "layer 4 is listed twice"),
    ({"linear_attn_config.full_attn_layers": [0]}, "'linear_attn_config.full_attn_layers' holds 0"),
    ({"linear_attn_config.full_attn_layers": "4,8"}, "'linear_attn_config.full_attn_layers' = '4,8'"),
    ({"linear_attn_config.num_heads": "32"}, "'linear_attn_config.num_heads' = '32' is not an integer"),
    ({"linear_attn_config.head_dim": 0}, "'linear_attn_config.head_dim' = 0"),
    ({"linear_attn_config": [4]}, "'linear_attn_config' = [4] is not an object"),
    ({"mla_use_nope": False}, "'mla_use_nope' is false"),
    ({"moe_router_activation_func": "softmax"}, "'moe_router_activation_func' = 'softmax'"),
    ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu'"),
    ({"mlp_layer_types": ["dense"]}, "'mlp_layer_types'"),
    ({"layer_types": ["linear_attention"] * 3}, "'layer_types' must list one type per layer"),
])
def test_bad_config_names_the_field(change, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        parse_config(_bad(change))
    # the converter's reading (weights never opened) refuses it too, unless only the forward needs the field
    if "kv_lora_rank" not in str(change):
        with pytest.raises(ConfigError, match=re.escape(field)):
            parse_config(_bad(change), for_runtime=False)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return build_checkpoint(shared_root(tmp_path_factory), ARCH)


def test_hub_names_and_roles(src):
    """Every tensor of the hub-layout checkpoint has its role: KDA's projections, convs (stored apart), A_log and
    dt_bias are attention, o_norm a norm; the MoE block is block_sparse_moe (w1/w3/w2, gate + correction bias,
    shared_experts); layer 0's dense MLP stays under mlp.; nothing is skipped."""
    with open_source(src) as s:
        roles = {n: s.arch.classify(n) for n in s.tensor_names()}
        assert s.arch.moe_layers() == [1, 2, 3]
        p = "model.layers."
        for n in ("0.self_attn.q_conv1d.weight", "0.self_attn.A_log", "0.self_attn.dt_bias",
                  "3.self_attn.f_b_proj.weight", "1.self_attn.g_a_proj.weight", "2.self_attn.kv_b_proj.weight",
                  "2.self_attn.q_proj.weight"):
            assert roles[p + n].kind == "attention", n
        assert roles[p + "0.self_attn.o_norm.weight"].kind == "norm"
        assert roles[p + "2.self_attn.kv_a_layernorm.weight"].kind == "norm"
        assert roles[p + "0.mlp.gate_proj.weight"].kind == "dense_mlp"
        assert roles[p + "1.block_sparse_moe.gate.weight"].kind == "router"
        assert roles[p + "1.block_sparse_moe.gate.e_score_correction_bias"].kind == "router_bias"
        assert roles[p + "3.block_sparse_moe.shared_experts.down_proj.weight"].kind == "shared_expert"
        r = roles[p + "2.block_sparse_moe.experts.7.w3.weight"]
        assert (r.kind, r.layer, r.expert, r.proj) == ("expert", 2, 7, "up")
        assert not [n for n, r in roles.items() if r.kind == "skip"]
        assert s.read(p + "0.self_attn.k_conv1d.weight").shape == (192, 1, 4)


def test_pull_selects_the_release_files():
    """The release's files (moonshotai/Kimi-Linear-48B-A3B-Instruct): weights, configs, Kimi's tiktoken tokenizer;
    never its remote code."""
    from ktconvert.hub.plan import DEFAULT_INCLUDE, select_files
    files = ["config.json", "configuration_kimi.py", "generation_config.json", "modeling_kimi.py",
             "model-00001-of-00020.safetensors", "model.safetensors.index.json", "tiktoken.model",
             "tokenization_kimi.py", "tokenizer_config.json", "chat_template.jinja", "README.md", "figures/banner.png"]
    chosen, _skipped = select_files(files, DEFAULT_INCLUDE, ())
    assert sorted(chosen) == ["chat_template.jinja", "config.json", "generation_config.json",
                              "model-00001-of-00020.safetensors", "model.safetensors.index.json", "tiktoken.model",
                              "tokenizer_config.json"]


def test_inspect_reports_roles_and_placement(src):
    r = subprocess.run([sys.executable, "-m", "ktconvert", "inspect", str(src)], check=False, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "architecture: kimi_linear, 4 layers, 3 MoE layers, 8 routed experts (top 2), 1 shared" in r.stdout
    for role in ("expert", "attention", "shared_expert", "dense_mlp", "router", "router_bias", "norm"):
        assert re.search(rf"^\s+{role}\s+[\d,]+\s+\(", r.stdout, re.MULTILINE), (role, r.stdout)
    assert re.search(r"int4-amx\s+GPU\s+[\d.]+ [KM]B\s+CPU", r.stdout), r.stdout


# --- the forward ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(src):
    return transformers_model(src)


def _long_ids(eng: Engine) -> list[int]:
    ids = eng.tokenizer.encode(" ".join([PROMPT] * 8))
    assert len(ids) > 80                                     # past two KDA chunks (32 tokens)
    return ids


def _chunked_logits(eng: Engine, ids: list[int]):
    """Prefill 40 tokens (a chunk and a part), 30 more continuing that state, then one token at a time."""
    cache = eng.model.new_cache(512)
    parts = [ids[:40], ids[40:70]] + [[t] for t in ids[70:]]
    return torch.cat([eng.model.forward(Batch.build([(cache, p)], "cpu"), all_logits=True) for p in parts]), cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_and_decode_match_transformers(tmp_path_factory, reference, backend):
    eng = Engine(converted(tmp_path_factory, ARCH, "bf16"), ctx=512, use_kernels=backend == "kernels")
    cfg = eng.model.cfg
    assert cfg.layer_types == ("linear_attention",) * 2 + ("full_attention", "linear_attention")
    assert cfg.moe_layers == (1, 2, 3) and eng.model.kv_pool.layout.num_layers == 1   # KV for the MLA layer only
    ids = _long_ids(eng)
    want = reference_logits(reference, ids)
    got, cache = _chunked_logits(eng, ids)
    diff = (got - want).abs().max().item()
    print(f"kimi_linear bf16 {backend}: {len(ids)} tokens, max |logit diff| {diff:.3g} "
          f"(logit scale {want.abs().max():.3g})")
    assert diff < LOGIT_ATOL[backend], f"max |logit diff| {diff:.3g}"
    assert set(cache.recurrent) == {0, 1, 3}                 # one state per KDA layer, carried through the decode
    eng.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_32_tokens_are_transformers_argmax(tmp_path_factory, reference, backend):
    eng = Engine(converted(tmp_path_factory, ARCH, "bf16"), ctx=512, use_kernels=backend == "kernels")
    ids = eng.tokenizer.encode(PROMPT + " " + PROMPT)
    eng.add_request("a", ids, SamplingParams(max_tokens=32, ignore_eos=True))
    gen = []
    while eng.has_work():
        gen += [t for _r, t, _f in eng.step()]
    eng.close()
    assert len(gen) == 32
    gaps = greedy_gaps(reference_logits(reference, ids + gen), len(ids), gen)
    print(f"kimi_linear bf16 {backend}: greedy gap max {max(gaps):.3g}")
    assert max(gaps) <= GREEDY_GAP[backend], gaps


@pytest.mark.skipif(not kernels_available(), reason="libktkernels / runtime/ops/moe.py not available")
@pytest.mark.parametrize("method, gpu_method", [("int8-amx", "rtn-int8"), ("int4-amx", "rtn-int4")])
def test_quantized_chunked_forward_matches_transformers_on_its_weights(tmp_path_factory, src, method, gpu_method):
    """int8 / int4 experts on the CPU kernels, Linears quantized (rtn) and dequantized at load, against transformers
    on the same dequantized weights (tests/test_family_quantized.py's reference checkpoint), prefilled in chunks and
    decoded token by token; transformers takes ktrun's router choices and every place where its own differ must be a
    near-tie (the count is printed)."""
    from test_family_quantized import quantized_reference_checkpoint
    conv = converted(tmp_path_factory, ARCH, method, gpu_method=gpu_method)
    ref = transformers_model(quantized_reference_checkpoint(
        src, conv, shared_root(tmp_path_factory) / f"qref_{ARCH}_{method}_{gpu_method}"))
    eng = Engine(conv, ctx=512, use_kernels=True, gpu_weights="dequant")
    cfg, ids = eng.model.cfg, _long_ids(eng)
    with record_ktrun(cfg) as log:
        got, _cache = _chunked_logits(eng, ids)
    eng.close()
    with force_transformers(ref, cfg, log) as own:
        want = reference_logits(ref, ids)
    ties = compare(log, own)
    diff = (got - want).abs().max().item()
    print(f"kimi_linear {method}+{gpu_method} kernels: max |logit diff| {diff:.3g} (logit scale "
          f"{want.abs().max():.3g}); {ties}; near-ties met: {len(ties.flips)}")
    ties.check(QUANT_SCORE_BOUND)
    assert diff < QUANT_LOGIT_ATOL


def test_tokenization_matches_transformers(tmp_path_factory, src):
    """Kimi's tiktoken tokenizer (tiktoken.model + tokenizer_config.json, remote code on the hub: the reference is
    the tiktoken package with the release tokenizer's spec, tests/runtime_helpers.KimiReferenceTokenizer)."""
    eng = Engine(converted(tmp_path_factory, ARCH, "bf16"), ctx=256, use_kernels=False)
    hf = transformers_tokenizer(src)
    for text in (PROMPT, "", "  leading spaces and\nnewlines\t", "ünïcødé ✓ 123", "混合专家模型 It's 3.14"):
        assert eng.tokenizer.encode(text) == hf.encode(text), text
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert eng.tokenizer.apply_chat_template(msgs) == hf.apply_chat_template(msgs, add_generation_prompt=True)
    eng.close()


def test_bench_prints_decode_rate(tmp_path_factory):
    conv = converted(tmp_path_factory, ARCH, "int4-amx")
    r = subprocess.run([*KTRUN, "bench", str(conv), "--pp", "64", "--tg", "16", "--reps", "1"], check=False,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    tg = re.search(r"\|\s+tg16\s+\|\s+([\d.]+)", r.stdout)
    assert tg and float(tg.group(1)) > 0, r.stdout
    print(f"kimi_linear int4-amx: ktrun bench decode {tg.group(1)} tokens/s")
    state = 3 * (3 * 3 * 192 * 4 + 8 * 24 * 24 * 4)         # 3 KDA layers: conv window (3, 576) + S (8, 24, 24)
    assert f"recurrent_state_per_request: {state} bytes (3 linear-attention layers)" in r.stdout, r.stdout
    assert "kv_cache_per_token: 192 bytes (1 layer with KV)" in r.stdout, r.stdout


def test_bfloat16_runtime_stays_close_to_float32(tmp_path_factory):
    """The forward in bf16 (projections, conv, norms in bf16; KDA's state and decay in float32) against float32.
    Observed: KL mean 1.2e-4, max 2.1e-4 over a 3x prompt."""
    from runtime_helpers import kl
    conv = converted(tmp_path_factory, ARCH, "bf16")

    def logits(dtype):
        eng = Engine(conv, ctx=256, use_kernels=False, dtype=dtype)
        ids = eng.tokenizer.encode(" ".join([PROMPT] * 3))
        out = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True).float()
        eng.close()
        return out
    d = kl(logits(torch.float32), logits(torch.bfloat16))
    assert d.mean() < 3e-3 and d.max() < 1e-1, (d.mean(), d.max())
