"""DeepSeek-V4 in ktconvert: config.json read with every field the release uses (defaults and legacy spellings
checked against transformers' DeepseekV4Config), errors naming the field before any weight is read, the release's
own tensor names and their roles (transformers' conversion mapping reads the fixture back to identical logits:
tests/test_fixtures.py), conversions in bf16 / int8 / int4 checked by verify, inspect by role (the forward:
tests/test_deepseek_v4_runtime.py)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from ktlayouts.families import ConfigError, get_family, parse_config
from ktlayouts.families.deepseek_v4 import CSA, HCA, settings
from runtime_helpers import build_checkpoint, build_conversion, shared_root

from ktconvert.sources import SourceError, open_source
from ktconvert.sources.roles import adapter_for

REQUIRED = {"num_hidden_layers": 6, "hidden_size": 96, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 320}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return build_checkpoint(shared_root(tmp_path_factory), "deepseek_v4")


def _hf(raw: dict):
    from transformers import AutoConfig
    return AutoConfig.for_model("deepseek_v4", **{k: v for k, v in raw.items() if k != "model_type"})


def _ours(raw: dict):
    cfg = parse_config({"model_type": "deepseek_v4", **raw})
    return cfg, settings(cfg)


def _compare(raw: dict) -> None:
    hf = _hf(raw)
    cfg, s = _ours(raw)
    main, comp = hf.rope_parameters["main"], hf.rope_parameters["compress"]
    got = {"layer_types": cfg.layer_types, "mlp": s.mlp_layer_types, "rates": s.compress_rates, "hc": (s.hc_mult,
               s.hc_sinkhorn_iters, s.hc_eps), "limit": s.swiglu_limit, "window": cfg.sliding_window,
               "o": (s.o_groups, s.o_lora_rank), "index": (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk),
               "dims": (cfg.head_dim, s.rope_dim, s.q_lora_rank, cfg.num_kv_heads), "scoring": s.scoring,
               "routing": (cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.n_shared_experts),
               "rope": (cfg.rope.theta, s.compress_rope.theta, s.compress_rope.kind), "eps": cfg.rms_norm_eps,
               "max_position": cfg.max_position, "mtp": cfg.n_mtp_layers}
    want = {"layer_types": tuple(hf.layer_types), "mlp": tuple(hf.mlp_layer_types), "rates": hf.compress_rates,
                "hc": (hf.hc_mult, hf.hc_sinkhorn_iters, hf.hc_eps), "limit": hf.swiglu_limit, "window": hf.sliding_window,
                "o": (hf.o_groups, hf.o_lora_rank), "index": (hf.index_n_heads, hf.index_head_dim, hf.index_topk),
                "dims": (hf.head_dim, hf.qk_rope_head_dim, hf.q_lora_rank, hf.num_key_value_heads),
                "scoring": hf.scoring_func, "routing": (hf.norm_topk_prob, hf.routed_scaling_factor, hf.n_shared_experts),
                "rope": (main["rope_theta"], comp["rope_theta"], comp["rope_type"]), "eps": hf.rms_norm_eps,
                "max_position": hf.max_position_embeddings, "mtp": hf.num_nextn_predict_layers}
    assert got == want
    if s.compress_rope.kind == "yarn":
        assert (s.compress_rope.factor, s.compress_rope.original_max_position, s.compress_rope.attention_factor) == \
               (comp["factor"], comp["original_max_position_embeddings"], comp["attention_factor"])
    assert cfg.moe_layers == tuple(range(cfg.num_layers))     # every layer MoE (hash or top-k)


def test_defaults_are_transformers_defaults():
    _compare(REQUIRED)


def test_release_spellings_read_as_transformers_reads_them():
    """The release's config.json: per-layer compress_ratios (0 / 4 / 128, the MTP layer's too), num_hash_layers,
    qk_rope_head_dim, rope_theta + compress_rope_theta + YaRN rope_scaling, scoring_func sqrtsoftplus."""
    raw = {**REQUIRED, "compress_ratios": [0, 0, 4, 128, 4, 128, 0], "num_hash_layers": 2, "head_dim": 64,
           "qk_rope_head_dim": 16, "o_groups": 4, "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
           "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                            "beta_fast": 32, "beta_slow": 1}, "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0,
           "hc_mult": 4, "num_nextn_predict_layers": 1}
    _compare(raw)
    cfg, _ = _ours(raw)
    assert cfg.layer_types[:4] == ("sliding_attention", "sliding_attention", CSA, HCA)


def test_fixture_config_reads_as_transformers_reads_it(src):
    raw = json.loads((src / "config.json").read_text())
    _compare({k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype", "transformers_version")})


@pytest.mark.parametrize("change, field", [
    ({"num_experts_per_tok": None}, "'num_experts_per_tok'"),
    ({"n_routed_experts": 1}, "num_experts_per_tok=2"),
    ({"n_shared_experts": 2}, "n_shared_experts=2"),
    ({"num_key_value_heads": 4}, "num_key_value_heads=4"),
    ({"layer_types": ["sliding_attention"]}, "'layer_types' must list one type per layer"),
    ({"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, "'layer_types'[5] = 'full_attention'"),
    ({"compress_ratios": [0, 4, 8, 4, 0, 0]}, "'compress_ratios'[2] = 8"),
    ({"compress_ratios": [0, 4]}, "'compress_ratios' must list"),
    ({"compress_rates": {"sparse": 4}}, "'compress_rates'"),
    ({"compress_rates": {CSA: 0}}, "'compress_rates'['compressed_sparse_attention'] = 0"),
    ({"mlp_layer_types": ["moe"] * 5 + ["dense"]}, "'mlp_layer_types'[5] = 'dense'"),
    ({"num_hash_layers": -1}, "num_hash_layers=-1"),
    ({"hc_mult": 0}, "hc_mult=0"),
    ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters=0"),
    ({"hc_eps": 0.0}, "hc_eps=0.0"),
    ({"swiglu_limit": 0.0}, "swiglu_limit=0.0"),
    ({"sliding_window": 0}, "sliding_window=0"),
    ({"o_groups": 3}, "o_groups=3"),
    ({"q_lora_rank": 0}, "q_lora_rank=0"),
    ({"qk_rope_head_dim": 7}, "7 rotary dims"),
    ({"index_head_dim": 32}, "index_head_dim=32"),
    ({"index_topk": 0}, "index_topk=0"),
    ({"scoring_func": "relu"}, "'scoring_func' = 'relu'"),
    ({"hidden_size": "96"}, "'hidden_size'"),
])
def test_config_errors_name_the_field(change, field):
    raw = {k: v for k, v in {"model_type": "deepseek_v4", **REQUIRED, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
        parse_config(raw)
    with pytest.raises(SourceError, match=field.replace("[", r"\[")):     # the converter, before any weight
        adapter_for(raw)


def test_release_tensor_names_and_roles():
    cfg = parse_config({"model_type": "deepseek_v4", **REQUIRED}, for_runtime=False)
    names = get_family("deepseek_v4").names

    def role(n):
        return names.classify(n, cfg)
    assert (names.embed, names.head, names.final_norm) == ("embed.weight", "head.weight", "norm.weight")
    assert names.router_weight(3) == "layers.3.ffn.gate.weight"
    want = {
        "layers.2.ffn.experts.7.w1.weight": ("expert", 2, 7, "gate"),
        "layers.2.ffn.experts.7.w3.weight": ("expert", 2, 7, "up"),
        "layers.2.ffn.experts.7.w2.weight": ("expert", 2, 7, "down"),
        "layers.2.ffn.shared_experts.w2.weight": ("shared_expert", 2, None, "down"),
        "layers.2.ffn.gate.weight": ("router", 2, None, None),
        "layers.2.ffn.gate.bias": ("router_bias", 2, None, None),
        "layers.0.ffn.gate.tid2eid": ("kept", 0, None, None),
        "layers.2.hc_attn_fn": ("kept", 2, None, None),
        "layers.2.hc_ffn_scale": ("kept", 2, None, None),
        "hc_head_base": ("kept", None, None, None),
        "layers.2.attn.attn_sink": ("kept", 2, None, None),
        "layers.2.attn.compressor.ape": ("kept", 2, None, None),
        "layers.2.attn.indexer.compressor.ape": ("kept", 2, None, None),
        "layers.2.attn.compressor.norm.weight": ("norm", 2, None, None),
        "layers.2.attn.indexer.compressor.wgate.weight": ("attention", 2, None, None),
        "layers.2.attn.indexer.wq_b.weight": ("attention", 2, None, None),
        "layers.2.attn.indexer.weights_proj.weight": ("attention", 2, None, None),
        "layers.2.attn.wo_a.weight": ("attention", 2, None, None),
        "layers.2.attn.q_norm.weight": ("norm", 2, None, None),
        "layers.2.attn_norm.weight": ("norm", 2, None, None),
        "layers.2.attn.wq_b.scale": ("skip", None, None, None),              # FP8 block / FP4 scales
        "layers.2.ffn.experts.7.w1.scale": ("skip", None, None, None),
        "embed.weight": ("embedding", None, None, None),
        "head.weight": ("head", None, None, None),
        "norm.weight": ("norm", None, None, None),
    }
    for name, (kind, layer, expert, proj) in want.items():
        r = role(name)
        assert (r.kind, r.layer, r.expert, r.proj) == (kind, layer, expert, proj), name
    mtp = role("mtp.0.attn.wq_a.weight")
    assert mtp.kind == "skip" and "multi-token-prediction" in mtp.reason
    from ktlayouts.families import TensorNameError
    with pytest.raises(TensorNameError, match="layers.6.attn.wq_a.weight: layer 6 is beyond"):
        role("layers.6.attn.wq_a.weight")
    with pytest.raises(TensorNameError, match="model.layers.0.self_attn.q_a_proj.weight: unknown tensor name"):
        role("model.layers.0.self_attn.q_a_proj.weight")     # transformers' names are not the release's


def test_fixture_every_layer_kind_present(src):
    raw = json.loads((src / "config.json").read_text())
    cfg = parse_config(raw)
    assert set(cfg.layer_types) == {"sliding_attention", CSA, HCA}
    assert set(settings(cfg).mlp_layer_types) == {"hash_moe", "moe"}
    with open_source(src) as s:
        kinds = {s.arch.classify(n).kind for n in s.tensor_names()}
        assert {"expert", "router", "router_bias", "shared_expert", "attention", "norm", "kept", "embedding",
                "head"} <= kinds
        tid = s.read("layers.0.ffn.gate.tid2eid")           # stored I32, read exactly
        assert tid.shape == (320, 2) and torch.equal(tid, tid.round()) and 0 <= tid.min() and tid.max() < 8


@pytest.mark.parametrize("method", ["bf16", "int8-amx", "int4-amx"])
def test_quantize_and_verify(src, tmp_path_factory, method):
    from click.testing import CliRunner

    from ktconvert.cli import main
    out = build_conversion(src, shared_root(tmp_path_factory) / f"conv_deepseek_v4_{method}", method)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_type"] == "deepseek_v4"
    from safetensors.torch import load_file
    dense = {}
    for f in sorted((out / "dense").glob("*.safetensors")):
        dense.update(load_file(str(f)))
    assert dense["layers.0.ffn.gate.tid2eid"].dtype == torch.float32      # kept tensors: F32, exact
    assert dense["layers.1.hc_attn_fn"].dtype == torch.float32
    assert dense["layers.1.attn.attn_sink"].dtype == torch.float32
    r = CliRunner().invoke(main, ["verify", str(out), "--against", str(src)])
    assert r.exit_code == 0 and "verify: OK" in r.output, r.output
    if method != "int4-amx":      # int8 / bf16 hold the bf16 source's experts exactly: nothing off
        assert "0 above the limit" in r.output


def test_inspect_reports_roles(src):
    from click.testing import CliRunner

    from ktconvert.cli import main
    r = CliRunner().invoke(main, ["inspect", str(src)])
    assert r.exit_code == 0, r.output
    assert "deepseek_v4, 4 layers, 4 MoE layers, 8 routed experts (top 2), 1 shared" in r.output
    for kind in ("expert", "attention", "shared_expert", "kept", "router"):
        assert f"  {kind} " in r.output


def test_calibration_refused_with_the_reason(src, tmp_path):
    from ktconvert.pipeline import ConvertOptions, convert
    with pytest.raises(Exception, match="calibration does not run deepseek_v4 layer by layer"):
        convert(src, tmp_path / "out", ConvertOptions(method="int4-amx", gpu_method="gptq-int4"),
                show_progress=False)


def test_the_experts_clamp_is_the_kernels_activation(src):
    """swiglu_limit becomes the routed experts' ExpertActivation "silu_clamped" (KT_ACT_SILU_CLAMPED in the kernels)."""
    cfg = parse_config(json.loads((src / "config.json").read_text()))
    assert (cfg.expert_activation.kind, cfg.expert_activation.limit, cfg.expert_activation.bias) == \
        ("silu_clamped", 0.5, False)



# --- the release's quantization: FP8 blocks + FP4 experts, scales under X.scale -------------------------------------
@pytest.fixture(scope="module")
def src_fp8(tmp_path_factory):
    return build_checkpoint(shared_root(tmp_path_factory), "deepseek_v4", fp8=True)


def _stored(d):
    from safetensors import safe_open
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]

    def read(name):
        with safe_open(d / wm[name], "pt") as f:
            return f.get_tensor(name)
    return wm, read


def test_release_format_on_disk(src_fp8):
    cfg = json.loads((src_fp8 / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4"
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                          "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    wm, read = _stored(src_fp8)
    w, s = read("layers.1.ffn.experts.3.w2.weight"), read("layers.1.ffn.experts.3.w2.scale")
    assert (w.dtype, tuple(w.shape), s.dtype, tuple(s.shape)) == (torch.int8, (96, 48), torch.float8_e8m0fnu, (96, 3))
    w, s = read("layers.1.attn.wq_b.weight"), read("layers.1.attn.wq_b.scale")
    assert (w.dtype, tuple(w.shape), s.dtype, tuple(s.shape)) == (torch.float8_e4m3fn, (128, 48),
                                                                  torch.float8_e8m0fnu, (1, 1))
    for bf16 in ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.weights_proj.weight",
                 "layers.1.ffn.gate.weight", "embed.weight"):
        assert read(bf16).dtype == torch.bfloat16 and bf16.removesuffix(".weight") + ".scale" not in wm


def test_reader_equals_transformers_dequantizer(src_fp8):
    """Every FP8 / FP4 weight read by ktconvert equals transformers' own Fp8Dequantize of the stored bytes."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    wm, read = _stored(src_fp8)
    deq = Fp8Dequantize(None)
    scales = [n for n in wm if n.endswith(".scale")]
    assert len(scales) == 4 * (8 * 3 + 3 + 5) + 2     # experts, shared expert, attention (+ 2 CSA indexers' wq_b)
    with open_source(src_fp8) as s:
        for n in scales:
            base = n.removesuffix(".scale")
            ref = deq._dequantize_one(read(base + ".weight"), read(n), torch.float32)
            assert torch.equal(s.read(base + ".weight"), ref), base


def test_auto_takes_the_release_over_exactly(src_fp8, tmp_path_factory, caplog):
    """--method auto: the FP4 experts' codes and scales copied into int8 g32 (error 0); the FP8 Linears are exact
    in bf16 GPU layers; verify finds every tensor equal to the source's own dequantized values."""
    import logging

    from click.testing import CliRunner

    from ktconvert.cli import main
    with caplog.at_level(logging.INFO, logger="ktconvert"):
        out = build_conversion(src_fp8, shared_root(tmp_path_factory) / "conv_deepseek_v4_release_auto", "auto",
                               gpu_method="bf16", group_size=None)
    assert caplog.text.count("experts: 24 taken over exactly from deepseek-v4 mxfp4") == 4     # every MoE layer
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_type"] == "deepseek_v4"
    r = CliRunner().invoke(main, ["verify", str(out), "--against", str(src_fp8)])
    assert r.exit_code == 0, r.output
    assert "126 tensors compared, 126 equal to the source's own dequantized values (error 0)" in r.output


@pytest.mark.parametrize("tensor, value, message", [
    ("layers.1.ffn.experts.3.w1.scale", 255, "E8M0 NaN scale"),
    ("layers.1.attn.wq_b.scale", 255, "E8M0 NaN scale"),
])
def test_bad_scales_named(src_fp8, tmp_path, tensor, value, message):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "bad"
    shutil.copytree(src_fp8, d)
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = d / wm[tensor]
    tensors = load_file(str(shard))
    bad = tensors[tensor].view(torch.uint8).clone()
    bad.view(-1)[0] = value
    tensors[tensor] = bad.view(torch.float8_e8m0fnu)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with open_source(d) as s, pytest.raises(SourceError, match=message):
        s.read(tensor.removesuffix(".scale") + ".weight")


def test_wrong_scale_shape_named(src_fp8, tmp_path):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "bad"
    shutil.copytree(src_fp8, d)
    name = "layers.2.ffn.experts.0.w3.scale"
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = load_file(str(d / wm[name]))
    tensors[name] = tensors[name][:, :2].contiguous()
    save_file(tensors, str(d / wm[name]), metadata={"format": "pt"})
    with pytest.raises(SourceError, match=r"layers.2.ffn.experts.0.w3.scale.*one E8M0 scale per 32 inputs"):
        open_source(d)


def test_pull_selects_the_release_files():
    """The release repo's layout: weights, index, configs and tokenizer at the top; DeepSeek's inference code (with
    its own config JSONs) and chat-encoding code in folders, which conversion never needs (no remote code)."""
    from ktconvert.hub.plan import select_files
    listing = ["config.json", "generation_config.json", "model.safetensors.index.json",
               "model-00001-of-00046.safetensors", "model-00046-of-00046.safetensors", "tokenizer.json",
               "tokenizer_config.json", "README.md", "LICENSE", "inference/model.py", "inference/kernel.py",
               "inference/convert.py", "inference/generate.py", "inference/config.json",
               "inference/requirements.txt", "encoding/encoding_dsv4.py", "encoding/README.md"]
    selected, skipped = select_files(listing, None, None)
    assert sorted(selected) == sorted(["config.json", "generation_config.json", "model.safetensors.index.json",
                                       "model-00001-of-00046.safetensors", "model-00046-of-00046.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"])
    assert skipped == []
