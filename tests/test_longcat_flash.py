"""LongCat-Flash (Meituan) in ktconvert and ktrun against transformers' LongcatFlashForCausalLM.

The fixture (ktconvert.testing.families "longcat_flash", built with the transformers class): 2 decoder layers, each
two MLA sublayers (4 KV cache slots) + two dense MLPs + the shortcut MoE; 8 routed experts 80 wide (not a multiple
of 64: padded tiles) and 4 zero (identity) experts, top 3; prompts of 66 tokens (longer than every top-k). Shown here:
the release's config.json fields and errors naming the field (before any weight is read); hub names and roles
(experts to the CPU expert files, everything else GPU layers, the MTP module skipped); bf16 / int8 / int4 conversions'
logits and 32-token greedy continuations against transformers, with every router choice compared tie-aware (ktrun's
choices forced on transformers; flips must be near-ties the score error explains; the count of ties met is
printed); zero experts chosen by the router and never reaching the expert executor; tokenization; `ktconvert
inspect`; `ktrun bench`'s decode rate. (The fixture also runs through every ARCHS-parametrized test.)
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from discrete_choices import compare, force_transformers, greedy_with_choices, record_ktrun
from ktlayouts.families import ConfigError, get_family, parse_config
from ktrun.engine import Engine
from ktrun.models import longcat_flash as lc
from ktrun.models.attention import mla_cache_widths
from ktrun.models.kv_cache import Batch
from ktrun.ops.library import kernels_available
from runtime_helpers import (
    KTRUN,
    PROMPT,
    build_checkpoint,
    converted,
    greedy_gaps,
    kl,
    reference_logits,
    shared_root,
    transformers_model,
    transformers_tokenizer,
)

from ktconvert.hub.plan import select_files
from ktconvert.pipeline import ConvertOptions, convert
from ktconvert.sources import SourceError, open_source

ARCH = "longcat_flash"
E, Z, K = 8, 4, 3                      # the fixture's routed experts, zero experts, top-k
KERNELS = pytest.mark.skipif(not kernels_available(), reason="libktkernels not available on this machine")

# The release's config.json (meituan-longcat/LongCat-Flash-Chat), the fields it carries
RELEASE = {
    "architectures": ["LongcatFlashForCausalLM"], "model_type": "longcat_flash", "attention_method": "MLA",
    "vocab_size": 131072, "hidden_size": 6144, "ffn_hidden_size": 12288, "expert_ffn_hidden_size": 2048,
    "num_layers": 28, "num_attention_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 512, "zero_expert_num": 256,
    "zero_expert_type": "identity", "moe_topk": 12, "routed_scaling_factor": 6.0, "router_bias": False,
    "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "rope_theta": 10000000.0,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16"}

# max |logit diff| against transformers (logit scale ~5.6 at INIT_SCALE), after forcing ktrun's router choices on
# transformers. Observed: bf16 reference 2.9e-6 (float32 both sides), bf16 kernels 1.5e-3 (activations rounded to
# bf16), int8 kernels 9.0e-3 (int8 activations and weights), int4 kernels 7.7e-2 (int4 g128 experts).
LOGIT_BOUND = {("bf16", "reference"): 1e-4, ("bf16", "kernels"): 1e-2, ("int8-amx", "kernels"): 3e-2,
               ("int4-amx", "kernels"): 2.5e-1}
INT4_KL_MEAN, INT4_KL_MAX = 1e-2, 1e-1          # the house int4 bounds (tests/test_runtime_quantized.py)
GREEDY_GAP = {("bf16", "reference"): 1e-3, ("bf16", "kernels"): 3e-2, ("int8-amx", "kernels"): 6e-2}
# router choice scores (softmax + correction bias) relative to the row's top score
SCORE_BOUND = {("bf16", "reference"): 1e-5, ("bf16", "kernels"): 1e-3, ("int8-amx", "kernels"): 1e-2,
               ("int4-amx", "kernels"): 2e-2}
CASES = [("bf16", "reference"), pytest.param("bf16", "kernels", marks=KERNELS),
         pytest.param("int8-amx", "kernels", marks=KERNELS), pytest.param("int4-amx", "kernels", marks=KERNELS)]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return build_checkpoint(shared_root(tmp_path_factory), ARCH)


@pytest.fixture(scope="module")
def ref(src):
    return transformers_model(src)


def _prompt(eng) -> list[int]:
    return eng.tokenizer.encode(PROMPT + " " + PROMPT)


# --- config.json --------------------------------------------------------------------------------------------------

def test_release_config_reads_as_transformers_does():
    from transformers import LongcatFlashConfig

    cfg = parse_config(RELEASE)
    hf = LongcatFlashConfig(**{k: v for k, v in RELEASE.items() if k not in ("architectures", "model_type")})
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads) == (hf.num_layers, hf.hidden_size, hf.num_attention_heads)
    assert cfg.moe_layers == tuple(range(28)) and cfg.n_shared_experts == 0
    assert (cfg.num_experts, cfg.zero_experts, cfg.top_k) == (hf.n_routed_experts, hf.zero_expert_num, hf.moe_topk)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size) == (hf.expert_ffn_hidden_size, hf.ffn_hidden_size)
    assert cfg.routed_scaling_factor == hf.routed_scaling_factor and not cfg.norm_topk_prob
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim)
    assert cfg.rope.theta == hf.rope_parameters["rope_theta"] and cfg.rope.dim == hf.head_dim and cfg.rope.interleaved
    assert cfg.softmax_scale == hf.qk_head_dim ** -0.5 and cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    # two MLA sublayers per layer: 56 latent caches of kv_lora_rank + qk_rope_head_dim per position
    assert lc.cache_layers(cfg) == 2 * hf.num_layers == hf.num_hidden_layers
    assert lc.cache_widths(cfg) == mla_cache_widths(cfg) == [(576,)]
    # conversion needs only what decides the files
    conv = parse_config({k: v for k, v in RELEASE.items() if k not in ("vocab_size", "num_attention_heads")},
                        for_runtime=False)
    assert conv.num_experts == 512 and conv.vocab_size is None


def test_defaults_are_transformers_defaults():
    from transformers import LongcatFlashConfig

    raw = {k: RELEASE[k] for k in ("num_layers", "hidden_size", "n_routed_experts", "moe_topk",
                                   "expert_ffn_hidden_size", "ffn_hidden_size", "num_attention_heads",
                                   "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size")}
    ours, hf = parse_config({"model_type": ARCH, **raw}), LongcatFlashConfig(**raw)
    assert (ours.zero_experts, ours.routed_scaling_factor, ours.q_lora_rank, ours.rms_norm_eps, ours.max_position,
            ours.rope.theta, ours.attention_bias, ours.tie_word_embeddings) == \
        (hf.zero_expert_num, hf.routed_scaling_factor, hf.q_lora_rank, hf.rms_norm_eps, hf.max_position_embeddings,
         hf.rope_parameters["rope_theta"], hf.attention_bias, hf.tie_word_embeddings)


@pytest.mark.parametrize("change, field", [
    ({"num_layers": None}, "'num_layers'"),
    ({"n_routed_experts": None}, "'n_routed_experts'"),
    ({"expert_ffn_hidden_size": None}, "'expert_ffn_hidden_size'"),
    ({"moe_topk": None}, "'moe_topk'"),
    ({"moe_topk": 769}, "moe_topk=769"),
    ({"zero_expert_num": -1}, "zero_expert_num=-1"),
    ({"zero_expert_type": "constant"}, "zero_expert_type='constant'"),
    ({"mla_scale_q_lora": False}, "mla_scale_q_lora=False"),
    ({"mla_scale_kv_lora": False}, "mla_scale_kv_lora=False"),
    ({"num_hidden_layers": 30}, "num_hidden_layers=30"),
    ({"head_dim": 128}, "head_dim=128"),
    ({"qk_head_dim": 128}, "qk_head_dim=128"),
    ({"q_lora_rank": 0}, "q_lora_rank=0"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_method": "LSA"}, "attention_method='LSA'"),
    ({"hidden_size": "6144"}, "'hidden_size'"),
    ({"kv_lora_rank": None}, "'kv_lora_rank'"),
])
def test_bad_config_names_the_field(change, field):
    raw = {k: v for k, v in {**RELEASE, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        parse_config(raw)


def test_num_hidden_layers_either_spelling_is_accepted():
    for n in (28, 56):        # vLLM's config reads num_hidden_layers as num_layers; transformers' derives 2 x it
        assert parse_config({**RELEASE, "num_hidden_layers": n}).num_layers == 28


def test_conversion_refuses_a_bad_config_before_reading_weights(src, tmp_path):
    bad = Path(shutil.copytree(src, tmp_path / "bad"))
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "zero_expert_type": "constant"}))
    for shard in bad.glob("*.safetensors"):          # any read of a weight would fail differently
        shard.write_bytes(b"\0" * 8)
    with pytest.raises(SourceError, match=r"config\.json: zero_expert_type='constant' is not supported"):
        convert(bad, tmp_path / "out", ConvertOptions(method="bf16"), show_progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


# --- hub names and roles ------------------------------------------------------------------------------------------

def test_hub_names_and_roles(src, tmp_path_factory):
    with open_source(src) as s:
        roles = {n: s.arch.classify(n) for n in s.tensor_names()}
        assert s.arch.n_experts == E and s.arch.moe_layers() == [0, 1]
    kinds = {r.kind for r in roles.values()}
    assert kinds == {"expert", "router", "router_bias", "attention", "dense_mlp", "norm", "embedding", "head"}
    experts = [n for n, r in roles.items() if r.kind == "expert"]
    assert len(experts) == 2 * E * 3 and all(".mlp.experts." in n for n in experts)
    assert roles["model.layers.1.mlp.router.classifier.weight"].kind == "router"
    assert roles["model.layers.1.mlp.router.e_score_correction_bias"].kind == "router_bias"
    assert (roles["model.layers.0.mlps.1.down_proj.weight"].kind, roles["model.layers.0.mlps.1.down_proj.weight"].proj) \
        == ("dense_mlp", "down")
    assert roles["model.layers.1.self_attn.1.kv_b_proj.weight"].kind == "attention"
    assert roles["model.layers.0.post_attention_layernorm.1.weight"].kind == "norm"
    names, cfg = get_family(ARCH).names, parse_config(json.loads((src / "config.json").read_text()))
    mtp = names.classify("model.mtp.layers.0.self_attn.0.q_a_proj.weight", cfg)    # the release's MTP module
    assert mtp.kind == "skip" and "multi-token-prediction" in mtp.reason
    # the router scores routed + zero experts; the zero ones have no tensors
    with open_source(src) as s:
        assert tuple(s.info("model.layers.0.mlp.router.classifier.weight").shape) == (E + Z, 96)
    # converted: experts only in the CPU expert files, everything else in the GPU layers
    conv = converted(tmp_path_factory, ARCH, "bf16")
    m = json.loads((conv / "manifest.json").read_text())
    dense = {n for f in m["files"].values() if f["kind"] in ("dense", "globals") for n in f["tensors"]}
    assert not [n for n in dense if ".mlp.experts." in n]
    assert {"model.layers.0.mlp.router.classifier.weight", "model.layers.1.mlps.0.gate_proj.weight",
            "model.layers.1.self_attn.1.q_b_proj.weight"} <= dense
    assert any(f["kind"] == "expert" for f in m["files"].values())


def test_pull_selects_the_release_files():
    """The release repo's kinds of files: weights, index, configs, tokenizer; no remote code, no report, no figures."""
    repo = ["config.json", "configuration_longcat_flash.py", "modeling_longcat_flash.py", "generation_config.json",
            "model-00001-of-00075.safetensors", "model-00075-of-00075.safetensors", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "README.md", "LICENSE",
            "tech_report.pdf", "figures/overview.png", ".gitattributes"]
    selected, skipped = select_files(repo, None, None)
    assert sorted(selected) == ["config.json", "generation_config.json", "model-00001-of-00075.safetensors",
                                "model-00075-of-00075.safetensors", "model.safetensors.index.json",
                                "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"] and not skipped


# --- the router and its zero experts ------------------------------------------------------------------------------

def test_split_zero_experts():
    cfg = dataclasses.replace(parse_config(RELEASE), num_experts=4, zero_experts=2, top_k=3)
    ids = torch.tensor([[0, 4, 5], [3, 1, 2], [5, 4, 1]])
    wts = torch.tensor([[0.5, 0.25, 0.125], [1.0, 2.0, 3.0], [0.5, 1.5, 2.0]])
    real, w, identity = lc.split_zero_experts(cfg, ids, wts)
    assert real.tolist() == [[0, -1, -1], [3, 1, 2], [-1, -1, 1]]
    assert w.tolist() == [[0.5, 0.0, 0.0], [1.0, 2.0, 3.0], [0.0, 0.0, 2.0]]
    assert identity.tolist() == [[0.375], [0.0], [2.0]]


def test_zero_experts_are_chosen_and_never_reach_the_executor(tmp_path_factory):
    eng = Engine(converted(tmp_path_factory, ARCH, "bf16"), ctx=256, use_kernels=False)
    seen = []
    submit = eng.model.experts.submit

    def spy(layer, x, ids, weights, out, **kw):
        seen.append((ids.clone(), weights.clone()))
        return submit(layer, x, ids, weights, out, **kw)

    eng.model.experts.submit = spy
    try:
        with record_ktrun(eng.model.cfg) as log:
            eng.model.forward(Batch.build([(eng.model.new_cache(256), _prompt(eng))], "cpu"), all_logits=True)
    finally:
        eng.close()
    picks = torch.stack([c.ids for c in log.rows.values()])                      # (rows, k) of E + Z
    zero = int((picks >= E).sum())
    assert 0 < zero < picks.numel(), f"{zero} of {picks.numel()} picks are zero experts"
    print(f"zero experts: {zero} of {picks.numel()} router picks ({zero / picks.numel():.0%})")
    ids = torch.cat([i for i, _ in seen])
    assert int(ids.max()) < E and int((ids < 0).sum()) == zero                 # skipped: id -1 ...
    assert float(torch.cat([w for _, w in seen])[ids < 0].abs().sum()) == 0.0   # ... with weight 0


# --- logits, greedy continuations, tie-aware router comparison ----------------------------------------------------

def _chunked_logits(eng, ids: list[int]) -> torch.Tensor:
    """Prefill 7 tokens, then 9 continuing the cache (both sublayers' slots), then one token at a time."""
    cache = eng.model.new_cache(256)
    parts = [ids[:7], ids[7:16]] + [[t] for t in ids[16:]]
    return torch.cat([eng.model.forward(Batch.build([(cache, p)], "cpu"), all_logits=True) for p in parts])


@pytest.mark.parametrize("method, backend", CASES)
def test_logits_match_transformers_tie_aware(tmp_path_factory, src, ref, method, backend):
    eng = Engine(converted(tmp_path_factory, ARCH, method), ctx=256, use_kernels=backend == "kernels")
    try:
        cfg = eng.model.cfg
        assert eng.model.cache_layout().num_layers == 4           # two latent caches per layer
        ids = _prompt(eng)
        assert len(ids) > K + Z + E
        with record_ktrun(cfg) as log:
            got = _chunked_logits(eng, ids)
    finally:
        eng.close()
    free = reference_logits(ref, ids)
    with force_transformers(ref, cfg, log) as own:
        want = reference_logits(ref, ids)
    rep = compare(log, own)
    print(f"{method} {backend}: {rep}; ties met: {len(rep.flips)}")
    rep.check({"router": SCORE_BOUND[method, backend]})
    diff = (got - want).abs().max().item()
    print(f"{method} {backend}: max |logit diff| {diff:.3g} (forced), {(got - free).abs().max().item():.3g} (free)")
    assert diff < LOGIT_BOUND[method, backend], f"max |logit diff| {diff:.3g}"
    if method == "int4-amx":
        k = kl(want, got)
        print(f"int4-amx kernels: KL mean {k.mean():.3g} max {k.max():.3g}")
        assert k.mean().item() < INT4_KL_MEAN and k.max().item() < INT4_KL_MAX, f"KL mean {k.mean():.3g} max {k.max():.3g}"


@pytest.mark.parametrize("method, backend", CASES[:3])
def test_greedy_32_tokens_are_transformers_argmax_tie_aware(tmp_path_factory, ref, method, backend):
    eng = Engine(converted(tmp_path_factory, ARCH, method), ctx=256, use_kernels=backend == "kernels")
    cfg = eng.model.cfg
    ids = _prompt(eng)
    try:
        gen, log = greedy_with_choices(eng, ids, 32)
    finally:
        eng.close()
    assert len(gen) == 32
    with force_transformers(ref, cfg, log) as own:
        want = reference_logits(ref, ids + gen)
    rep = compare(log, own)
    gaps = greedy_gaps(want, len(ids), gen)
    print(f"{method} {backend}: {rep}; ties met: {len(rep.flips)}; max greedy gap {max(gaps):.3g}")
    rep.check({"router": SCORE_BOUND[method, backend]})
    assert max(gaps) <= GREEDY_GAP[method, backend], gaps


def test_tokenization_matches_transformers(src, tmp_path_factory):
    eng = Engine(converted(tmp_path_factory, ARCH, "bf16"), ctx=256, use_kernels=False)
    hf = transformers_tokenizer(src)
    try:
        for text in (PROMPT + " " + PROMPT, "", " two  spaces\nand a tab\t", "ünïcødé ✓ 123"):
            assert eng.tokenizer.encode(text) == hf(text).input_ids, text
        msgs = [{"role": "user", "content": "hi there"}]
        want = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        assert eng.tokenizer.apply_chat_template(msgs) == list(want["input_ids"] if hasattr(want, "keys") else want)
    finally:
        eng.close()


# --- CLIs ---------------------------------------------------------------------------------------------------------

def test_inspect_reports_roles_zero_experts_and_fit(src):
    r = subprocess.run([sys.executable, "-m", "ktconvert", "inspect", str(src), "--gpu-mem", "1GB",
                        "--cpu-mem", "1GB"], check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    print(out)
    assert "longcat_flash, 2 layers, 2 MoE layers, 8 routed experts (top 3), 4 zero (identity) experts" in out
    for role in ("expert", "dense_mlp", "attention", "router", "router_bias", "norm", "embedding", "head"):
        assert f"\n  {role} " in out, role
    assert "int4-amx" in out and "bf16" in out


def test_bench_prints_the_decode_rate(tmp_path_factory):
    conv = converted(tmp_path_factory, ARCH, "int4-amx")
    r = subprocess.run([*KTRUN, "bench", str(conv), "--pp", "16", "--tg", "16", "--reps", "1"], check=False,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    row = next(line for line in r.stdout.splitlines() if "tg16" in line)           # | model | backend | tg16 | t/s |
    assert float(row.split("|")[-2].split("±")[0]) > 0
    assert "kv_cache_per_token: 768 bytes (4 layers with KV)" in r.stdout    # 2 x 2 sublayers x (32 + 16) x 4 B
