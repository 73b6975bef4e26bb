"""The family registry (ktlayouts.families) holds together: every family has a fixture entry, a runtime module that
imports, GGUF names llama.cpp really uses, config defaults equal to its transformers config class, one resolution
rule, clear config errors; and ktrun takes the MoE layers from the manifest the converter wrote."""
from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import subprocess
import sys

import gguf
import pytest
import transformers
from ktlayouts.families import (
    ATTENTION_KINDS,
    FAMILIES,
    GGUF_ARCHS,
    ConfigError,
    family_for,
    get_family,
    load_config,
    parse_config,
)
from ktrun.loader import LoadError, load_converted
from runtime_helpers import converted

from ktconvert.sources import SourceError, open_source
from ktconvert.sources.roles import adapter_for
from ktconvert.testing import FIXTURES

NAMES = sorted(FAMILIES)


def test_every_family_has_a_fixture_entry_and_back():
    assert set(FIXTURES) == set(FAMILIES)


@pytest.mark.parametrize("name", NAMES)
def test_runtime_module_imports(name):
    mod = importlib.import_module(f"ktrun.models.{FAMILIES[name].runtime_module}")
    for attr in ("route", "attention", "cache_widths"):
        assert callable(getattr(mod, attr)), f"ktrun.models.{FAMILIES[name].runtime_module}.{attr}"


@pytest.mark.parametrize("name", NAMES)
def test_names_exist_in_transformers(name):
    """model_type and architecture class names are the ones transformers (the independent reference) defines."""
    fam = FAMILIES[name]
    assert name in transformers.CONFIG_MAPPING
    for cls in fam.architectures:
        assert hasattr(transformers, cls), cls
    for mt in fam.model_types:
        assert family_for({"model_type": mt}) is fam and get_family(mt) is fam


@pytest.mark.parametrize("arch", sorted(GGUF_ARCHS))
def test_gguf_rows_are_llama_cpp_names(arch):
    """Every GGUF name row matches a tensor name gguf-py (llama.cpp's constants) lists for that architecture."""
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    assert arch in by_name, f"{arch} is not a llama.cpp architecture"
    names = [gguf.TENSOR_NAMES[t].format(bid=3) + suffix for t in gguf.MODEL_TENSORS[by_name[arch]]
             for suffix in (".weight", ".bias", "")]          # "": blk.N.ssm_a has no suffix
    # llama.cpp's converters keep NextN (MTP) blocks for deepseek2 (GLM-4.7-Flash) and qwen3next too; the gguf-py
    # release on PyPI lists the nextn tensors for glm4moe only (llama.cpp's own gguf-py lists them for all three)
    names += [gguf.TENSOR_NAMES[t].format(bid=3) + ".weight" for t in gguf.MODEL_TENSOR if t.name.startswith("NEXTN")]
    for rx, template, _join, _part in GGUF_ARCHS[arch].compiled:
        assert any(rx.match(n) for n in names), f"{arch}: row {rx.pattern} -> {template} matches no gguf-py name"
    assert any(f.gguf is GGUF_ARCHS[arch] for f in FAMILIES.values())


def test_deepseek_v32_has_no_gguf_because_llama_cpp_has_no_indexer_there():
    """README: DeepSeek-V3.2 has no GGUF input. gguf-py (llama.cpp's constants) knows lightning-indexer tensors, but
    only for glm-dsa, not for deepseek2, which V3 / Kimi GGUFs use: a deepseek2 GGUF cannot carry V3.2's indexer, so
    reading one as V3.2 would silently run dense attention. Should gguf-py add them there, this fails and the family
    gets GGUF rows."""
    assert FAMILIES["deepseek_v32"].gguf is None
    indexer = {t for t in gguf.MODEL_TENSOR if t.name.startswith("INDEXER")}
    assert indexer and indexer <= set(gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GLM_DSA])
    assert not indexer & set(gguf.MODEL_TENSORS[gguf.MODEL_ARCH.DEEPSEEK2])


def test_registry_is_torch_free():
    code = ("import sys, ktlayouts.families; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'ktconvert', 'ktrun', 'transformers', 'gguf')); assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# --- config.json: transformers' defaults, one resolution rule, errors naming the field ----------------------------

# Fields a family requires (they decide the converted files, or the forward's shapes); every other field is left
# out below, so the registry must fill in what the transformers config class fills in.
REQUIRED = {"num_hidden_layers", "hidden_size", "n_routed_experts", "num_experts", "num_local_experts",
            "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "num_layers", "moe_topk", "expert_ffn_hidden_size", "ffn_hidden_size"}   # LongCat-Flash's names
# so that the defaults make a model transformers can build: V3's first_k_dense_replace=3 needs > 3 layers;
# Mixtral's num_key_value_heads=8 needs a multiple of 8 query heads
# GLM's, MiniMax's and gpt-oss's num_key_value_heads=8 too; DeepSeek-V3.2's and Kimi-K2.5's (V3's) first_k_dense_replace=3
# and n_group=8 (2+ experts per group).
SHAPE_FIX = {"deepseek_v3": {"num_hidden_layers": 5}, "mixtral": {"num_attention_heads": 8},
             "glm4_moe": {"num_attention_heads": 8}, "minimax_m2": {"num_attention_heads": 8},
             "gpt_oss": {"num_attention_heads": 8},
             "mimo_v2_flash": {"num_attention_heads": 8},
             "deepseek_v32": {"num_hidden_layers": 5, "n_routed_experts": 16},
             "kimi_k25": {"num_hidden_layers": 5, "n_routed_experts": 16},
             "kimi_linear": {"pad_token_id": 0}}      # its default pad id 163839 is past the test's vocabulary


def _rope_theta(hf) -> float:
    """transformers' rope theta (of the full-attention layers where kinds differ); a config without RoPE (Kimi
    Linear's NoPE MLA) reads as the 10000 ktlayouts keeps for its never-applied table."""
    rp = getattr(hf, "rope_parameters", None)
    if rp is None:
        return 10000.0
    return rp.get("full_attention", rp.get("main", rp))["rope_theta"]


def _minimal(name: str) -> dict:
    """The required fields only; a family whose text model's config is nested (Kimi-K2.5) gets them nested."""
    key = FIXTURES[name].text_config_key
    text = FIXTURES[name].config[key] if key else FIXTURES[name].config
    cfg = {k: v for k, v in text.items() if k in REQUIRED}
    cfg = {**cfg, "vocab_size": 320, **SHAPE_FIX.get(name, {})}
    return {key: cfg} if key else cfg


@pytest.mark.parametrize("name", NAMES)
def test_defaults_are_transformers_defaults(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = _minimal(name)
    hf_outer = AutoConfig.for_model(name, **raw)
    hf = getattr(hf_outer, "text_config", None) or hf_outer     # the text model's config (Kimi-K2.5: nested)
    ours = parse_config({"model_type": name, **raw})
    assert ours.attention in ATTENTION_KINDS and ours.model_type == name
    got = {"num_kv_heads": ours.num_kv_heads, "rms_norm_eps": ours.rms_norm_eps, "max_position": ours.max_position,
           "rope_theta": ours.rope.theta, "tie_word_embeddings": ours.tie_word_embeddings,
           "attention_bias": ours.attention_bias}
    want = {"num_kv_heads": hf.num_key_value_heads, "rms_norm_eps": hf.rms_norm_eps,
            "max_position": hf.max_position_embeddings, "rope_theta": _rope_theta(hf),
            "tie_word_embeddings": hf.tie_word_embeddings, "attention_bias": getattr(hf, "attention_bias", False)}
    if hasattr(hf, "norm_topk_prob"):
        got["norm_topk_prob"], want["norm_topk_prob"] = ours.norm_topk_prob, hf.norm_topk_prob
    if (name.startswith("deepseek") and name != "deepseek_v4") or name == "glm_moe_dsa":   # V4: no dense layers
        got.update(first_k_dense=ours.first_k_dense, n_shared_experts=ours.n_shared_experts,
                   routed_scaling_factor=ours.routed_scaling_factor, n_group=ours.n_group,
                   topk_group=ours.topk_group, q_lora_rank=ours.q_lora_rank)
        want.update(first_k_dense=hf.first_k_dense_replace, n_shared_experts=hf.n_shared_experts,
                    routed_scaling_factor=hf.routed_scaling_factor, n_group=hf.n_group or 1,
                    topk_group=hf.topk_group or 1, q_lora_rank=hf.q_lora_rank)
    if name in ("deepseek_v32", "glm_moe_dsa"):   # the lightning indexer (GLM-5.2: which layers run one)
        got.update(index=(ours.index_n_heads, ours.index_head_dim, ours.index_topk),
                   indexer_types=ours.indexer_types or None)
        want.update(index=(hf.index_n_heads, hf.index_head_dim, hf.index_topk),
                    indexer_types=tuple(hf.indexer_types) if name == "glm_moe_dsa" else None)
    if name in ("qwen3_next", "qwen3_5_moe"):   # hybrid: layer kinds, DeltaNet dims, partial rotary, shared expert
        la = ours.linear_attention
        got.update(layer_types=ours.layer_types, la=(la.conv_kernel, la.num_k_heads, la.num_v_heads, la.k_head_dim,
                                                     la.v_head_dim),
                   head_dim=ours.head_dim, rope_dim=ours.rope.dim, n_shared=ours.n_shared_experts)
        want.update(layer_types=tuple(hf.layer_types), la=(hf.linear_conv_kernel_dim, hf.linear_num_key_heads,
                                                           hf.linear_num_value_heads, hf.linear_key_head_dim,
                                                           hf.linear_value_head_dim),
                    head_dim=hf.head_dim, rope_dim=int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"]),
                    n_shared=1)
    if name == "qwen3_next":   # Qwen3.5-MoE has no dense MLP (transformers' config class drops the field)
        got["intermediate_size"], want["intermediate_size"] = ours.intermediate_size, hf.intermediate_size
    if name == "gpt_oss":      # sliding/full layers, window, head_dim, the clamped SwiGLU, no shared experts
        act = ours.expert_activation
        got.update(layer_types=ours.layer_types, sliding_window=ours.sliding_window, head_dim=ours.head_dim,
                   rope=(ours.rope.kind, ours.rope.factor, ours.rope.original_max_position, ours.rope.truncate),
                   act=(act.kind, act.alpha, act.limit, act.bias), sinks=ours.attention_sinks,
                   n_shared=ours.n_shared_experts)
        rp = hf.rope_parameters
        want.update(layer_types=tuple(hf.layer_types), sliding_window=hf.sliding_window, head_dim=hf.head_dim,
                    rope=(rp["rope_type"], rp["factor"], rp["original_max_position_embeddings"], rp["truncate"]),
                    act=("swiglu_clamped", hf.swiglu_alpha, hf.swiglu_limit, True), sinks=True, n_shared=0)
    if name == "kimi_linear":   # KDA / MLA layers, KDA sizes, grouped sigmoid routing, shared experts
        la = ours.linear_attention
        got.update(layer_types=ours.layer_types, la=(la.conv_kernel, la.num_v_heads, la.k_head_dim),
                   routing=(ours.n_group, ours.topk_group, ours.routed_scaling_factor, ours.n_shared_experts,
                            ours.q_lora_rank))
        want.update(layer_types=tuple(hf.layer_types), la=(hf.linear_conv_kernel_dim, hf.linear_num_heads,
                                                           hf.linear_head_dim),
                    routing=(hf.n_group, hf.topk_group, hf.routed_scaling_factor, hf.n_shared_experts, hf.q_lora_rank))
    if name == "mimo_v2_flash":   # per-kind layers, window, rope and kv heads; value head dim and scale
        sa, rp = ours.sliding_attention, hf.rope_parameters
        got.update(layer_types=ours.layer_types, sliding_window=ours.sliding_window, head_dim=ours.head_dim,
                   v_head_dim=ours.v_head_dim, value_scale=ours.value_scale, rope_dim=ours.rope.dim,
                   swa=(sa.num_kv_heads, sa.rope.theta, sa.rope.dim), routed_scaling_factor=ours.routed_scaling_factor)
        want.update(layer_types=tuple(hf.layer_types), sliding_window=hf.sliding_window, head_dim=hf.head_dim,
                    v_head_dim=hf.v_head_dim, value_scale=hf.attention_value_scale,
                    rope_dim=int(hf.head_dim * rp["full_attention"]["partial_rotary_factor"]),
                    swa=(2 * hf.num_key_value_heads, rp["sliding_attention"]["rope_theta"],
                         int(hf.head_dim * rp["sliding_attention"]["partial_rotary_factor"])),
                    routed_scaling_factor=hf.routed_scaling_factor)
    assert got == want
    from ktconvert.testing.checkpoints import model_class
    cls = model_class(name)
    model = (cls.from_config if cls is AutoModelForCausalLM else cls._from_config)(hf_outer)
    layers = getattr(model.model, "language_model", model.model).layers
    hf_moe = tuple(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
    assert ours.moe_layers == hf_moe and hf_moe, (ours.moe_layers, hf_moe)


def test_one_resolution_rule():
    v3 = get_family("deepseek_v3")
    kimi = {**_minimal("deepseek_v3"), "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    assert family_for(kimi) is v3 and parse_config(kimi).model_type == "deepseek_v3"
    assert adapter_for(kimi).model_type == "deepseek_v3"
    no_type = {"architectures": ["MixtralForCausalLM"]}
    assert family_for(no_type) is get_family("mixtral")
    with pytest.raises(ConfigError, match=r"model_type 'deepseek_v3' is deepseek_v3, but architectures\[0\] "
                                          r"'MixtralForCausalLM' is mixtral"):
        family_for({"model_type": "deepseek_v3", "architectures": ["MixtralForCausalLM"]})
    with pytest.raises(ConfigError, match="unsupported model_type 'llama4'"):   # architectures never override it
        family_for({"model_type": "llama4", "architectures": ["MixtralForCausalLM"]})
    with pytest.raises(ConfigError, match="missing required field 'model_type'"):
        family_for({"architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("name, change, field", [
    ("deepseek_v3", {"num_experts_per_tok": None}, "'num_experts_per_tok'"),
    ("deepseek_v3", {"n_group": 3}, "n_group=3"),
    ("deepseek_v3", {"n_group": 4, "topk_group": 5}, "topk_group=5"),
    ("deepseek_v3", {"num_experts_per_tok": 20}, "num_experts_per_tok=20"),
    ("deepseek_v3", {"n_group": 16, "topk_group": 4}, "n_group=16"),          # 1 expert per group
    ("deepseek_v2", {"topk_method": "group_limited_greedy"}, "'n_group'"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    ("qwen3_moe", {"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ("qwen3_moe", {"hidden_size": "128"}, "'hidden_size'"),
    ("mixtral", {"num_local_experts": 1}, "num_experts_per_tok=2"),
    ("qwen3_next", {"linear_num_value_heads": 3}, "linear_num_value_heads=3"),
    ("qwen3_next", {"layer_types": ["linear_attention"]}, "'layer_types' must list one type per layer"),
    ("qwen3_next", {"layer_types": ["linear_attention", "mamba"]}, "= 'mamba' is not one of"),
    ("qwen3_next", {"full_attention_interval": 0}, "full_attention_interval=0"),
    ("qwen3_next", {"partial_rotary_factor": 1.5}, "'partial_rotary_factor' = 1.5"),
    ("qwen3_next", {"linear_key_head_dim": "32"}, "'linear_key_head_dim'"),
    ("gpt_oss", {"layer_types": ["sliding_attention"]}, "'layer_types' must list one type per layer"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention"]}, "= 'chunked_attention' is not one of"),
    ("gpt_oss", {"sliding_window": 0}, "sliding_window=0"),
    ("gpt_oss", {"swiglu_limit": -1.0}, "swiglu_limit=-1.0"),
    ("gpt_oss", {"num_local_experts": None}, "'num_local_experts'"),
])
def test_config_errors_name_the_field(name, change, field):
    raw = {"model_type": name, **_minimal(name), **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
        parse_config(raw)
    with pytest.raises(SourceError, match=field):     # the converter, before any weight is read
        adapter_for(raw)


@pytest.mark.parametrize("change, field", [
    ({"linear_num_value_heads": 3}, "linear_num_value_heads=3"),
    ({"layer_types": ["linear_attention"]}, "'layer_types' must list one type per layer"),
    ({"layer_types": ["linear_attention", "mamba"]}, "= 'mamba' is not one of"),
    ({"full_attention_interval": 0}, "full_attention_interval=0"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}}, "'partial_rotary_factor' = 1.5"),
    ({"linear_key_head_dim": "32"}, "'linear_key_head_dim'"),
    ({"num_experts_per_tok": None}, "'num_experts_per_tok'"),
    ({"mlp_only_layers": [0]}, "'text_config.mlp_only_layers' is a Qwen3-Next field"),
    ({"model_type": "qwen3_next"}, "text_config.model_type 'qwen3_next' is not one of qwen3_5_moe_text"),
])
def test_nested_config_errors_name_the_field(change, field):
    """Qwen3.5-MoE: the text model's fields sit under text_config; errors say so."""
    text = {k: v for k, v in {**_minimal("qwen3_5_moe")["text_config"], **change}.items() if v is not None}
    raw = {"model_type": "qwen3_5_moe", "text_config": text}
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")) as e:
        parse_config(raw)
    assert "text_config" in str(e.value)
    with pytest.raises(SourceError, match=field):     # the converter, before any weight is read
        adapter_for(raw)
    with pytest.raises(ConfigError, match="missing required field 'text_config'"):
        parse_config({**text, "model_type": "qwen3_5_moe"})   # the text fields at the top, as Qwen3-Next has them


def test_converter_and_runtime_report_the_same_missing_field(ckpt_copy):
    d = ckpt_copy("qwen3_moe")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match=rf"{d / 'config.json'}: missing required field 'moe_intermediate_size'"):
        open_source(d)
    with pytest.raises(ConfigError, match=rf"{d / 'config.json'}: missing required field 'moe_intermediate_size'"):
        load_config(d / "config.json")


# --- the runtime takes the MoE layers from the manifest ----------------------------------------------------------

@pytest.fixture
def conv_copy(tmp_path_factory, tmp_path):
    src = converted(tmp_path_factory, "deepseek_v2", "bf16")      # first_k_dense_replace=1: MoE layers 1, 2
    return shutil.copytree(src, tmp_path / "conv")


def _edit_config(d, **kw):
    """Change config.json and re-list it in manifest.json (size, sha256), as a hand-edited conversion would."""
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kw)
    raw = json.dumps({k: v for k, v in cfg.items() if v is not None}).encode()
    (d / "config.json").write_bytes(raw)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"]["config.json"].update(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    (d / "manifest.json").write_text(json.dumps(manifest))


def test_runtime_moe_layers_come_from_the_manifest(conv_copy):
    _edit_config(conv_copy, first_k_dense_replace=None)   # the registry alone would now say layers 0, 1, 2
    assert parse_config(json.loads((conv_copy / "config.json").read_text())).moe_layers == (0, 1, 2)
    m = load_converted(conv_copy, device="cpu")
    assert m.config.moe_layers == m.geometry.moe_layers == (1, 2)


@pytest.mark.parametrize("change, message", [
    ({"n_routed_experts": 4, "num_experts_per_tok": 2}, "experts.n_experts=8 but config.json says routed experts=4"),
    ({"num_hidden_layers": 4}, "num_layers=3 but config.json says num_hidden_layers=4"),
    ({"moe_intermediate_size": 96}, "experts.intermediate=80 but config.json says expert intermediate size=96"),
])
def test_manifest_and_config_must_agree(conv_copy, change, message):
    _edit_config(conv_copy, **change)
    with pytest.raises(LoadError, match=message):
        load_converted(conv_copy, device="cpu")
