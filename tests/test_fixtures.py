"""The tiny checkpoint factory writes what the hub ships, and transformers reads it back to the same model."""
import json
import re

import pytest
import torch
from safetensors import safe_open

from ktconvert.testing import ARCHS, FIXTURES, make_checkpoint, make_model
from ktconvert.testing.checkpoints import model_class

EXPERT_NAME = {
    "deepseek_v3": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "deepseek_v2": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "qwen3_moe": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "mixtral": re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$"),
    "qwen3_next": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "glm4_moe": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "minimax_m2": re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$"),
    "deepseek_v32": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "glm4_moe_lite": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "glm_moe_dsa": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "qwen3_5_moe": re.compile(r"model\.language_model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "kimi_k25": re.compile(r"language_model\.model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "longcat_flash": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "kimi_linear": re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$"),
    "mimo_v2_flash": re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    # gpt-oss: the hub keeps each layer's experts fused, as transformers holds them (E, H, 2I) / (E, I, H)
    "gpt_oss": re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$"),
    # DeepSeek-V4: the release's own names (no model. prefix, ffn, w1/w3/w2)
    "deepseek_v4": re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$"),
}


def _text(cfg: dict) -> dict:
    """The text model's config.json keys (Kimi-K2.5 nests them under text_config)."""
    return cfg.get("text_config", cfg)


def _index(d):
    return json.loads((d / "model.safetensors.index.json").read_text())


def _dtypes(d) -> dict[str, tuple[str, tuple]]:
    """name -> (safetensors dtype, shape), read with the safetensors library itself."""
    out = {}
    for shard in sorted(set(_index(d)["weight_map"].values())):
        with safe_open(d / shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = f.get_slice(name)
                out[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def test_transformers_reloads_identical_logits(ckpt_dir, arch):
    d = ckpt_dir(arch)
    ref = make_model(arch)
    loaded, info = model_class(arch).from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    unexpected = set(info["unexpected_keys"])
    n = getattr(ref.config, "text_config", ref.config).num_hidden_layers
    if FIXTURES[arch].mtp:  # only the MTP layer, which transformers does not model
        assert unexpected and all(k.startswith(f"model.layers.{n}.") for k in unexpected), sorted(unexpected)[:5]
    else:
        assert not unexpected, sorted(unexpected)[:5]
    ids = torch.tensor([[1, 5, 9, 30, 200, 7, 3, 11, 250, 4]])
    with torch.no_grad():
        want, got = ref(ids).logits, loaded.eval()(ids).logits
    assert want.std() > 0
    assert torch.equal(want, got), (want - got).abs().max()


def test_hub_names_dtypes_and_shards(ckpt_dir, arch):
    d = ckpt_dir(arch)
    index = _index(d)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    meta = _dtypes(d)
    assert set(meta) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(
        torch.empty(s, dtype=torch.bfloat16 if dt == "BF16" else torch.float32).nbytes for dt, s in meta.values())
    names = list(meta)
    cfg = _text(json.loads((d / "config.json").read_text()))
    n_exp = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    experts = [n for n in names if EXPERT_NAME[arch].match(n)]
    if FIXTURES[arch].fused_experts:
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        assert len(experts) == 2 * cfg["num_hidden_layers"]
        assert meta["model.layers.1.mlp.experts.gate_up_proj"][1] == (n_exp, h, 2 * i)
        assert meta["model.layers.1.mlp.experts.down_proj"][1] == (n_exp, i, h)
        assert meta["model.layers.1.mlp.experts.gate_up_proj_bias"][1] == (n_exp, 2 * i)
        assert meta["model.layers.1.self_attn.sinks"][1] == (cfg["num_attention_heads"],)
    else:
        assert not [n for n in names if "gate_up_proj" in n or n.endswith("experts.down_proj")], "fused names leaked"
        n_layers = cfg[FIXTURES[arch].layers_key]          # LongCat-Flash's config.json counts num_layers
        main_experts = [n for n in experts if int(re.search(r"layers\.(\d+)\.", n).group(1)) < n_layers]
        n_moe = n_layers - cfg.get("first_k_dense_replace", 0)
        if isinstance(cfg.get("moe_layer_freq"), list):       # MiMo-V2-Flash: 0 (dense) / 1 (MoE) per layer
            n_moe = sum(cfg["moe_layer_freq"])
        assert len(main_experts) == n_moe * n_exp * 3
    fixture = FIXTURES[arch]
    for name, (dtype, _) in meta.items():
        if fixture.hub_int and re.match(fixture.hub_int, name):
            assert dtype == "I32", name
        else:
            f32 = name.endswith("e_score_correction_bias") or bool(fixture.hub_f32 and re.match(fixture.hub_f32, name))
            assert dtype == ("F32" if f32 else "BF16"), name
    if arch == "mixtral":
        assert "model.layers.0.block_sparse_moe.gate.weight" in meta
        assert meta["model.layers.0.block_sparse_moe.experts.7.w1.weight"][1] == (160, 96)
        assert meta["model.layers.0.block_sparse_moe.experts.7.w2.weight"][1] == (96, 160)
    if arch == "deepseek_v3":
        assert "model.layers.0.mlp.gate_proj.weight" in meta  # first_k_dense_replace dense layer
        assert "model.layers.1.mlp.shared_experts.up_proj.weight" in meta
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in meta


def test_config_generation_and_tokenizer_files(ckpt_dir, arch):
    from transformers import AutoConfig, AutoTokenizer

    d = ckpt_dir(arch)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["torch_dtype"] == "bfloat16"
    assert cfg["architectures"][0].endswith(("ForCausalLM", "ForConditionalGeneration"))
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] is False
    assert AutoConfig.from_pretrained(d).model_type == arch
    cfg = _text(cfg)
    if FIXTURES[arch].tokenizer == "kimi":   # tiktoken.model: checked against tiktoken in test_kimi_tokenizer.py
        pytest.skip("Kimi's tiktoken tokenizer has no transformers class without remote code")
    if arch == "qwen3_moe":
        assert cfg["num_experts"] == 8 and cfg["moe_intermediate_size"] % 64 != 0
    if arch == "deepseek_v3":
        assert cfg["num_nextn_predict_layers"] == 1 and cfg["first_k_dense_replace"] == 1
    gen = json.loads((d / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.eos_token_id == cfg["eos_token_id"] == gen["eos_token_id"]
    if tok.bos_token is not None:
        assert tok.bos_token_id == cfg["bos_token_id"]
        assert tok("hello").input_ids[0] == tok.bos_token_id
    assert len(tok) <= cfg["vocab_size"]
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "What is 2+2?" in text
    ids = tok("The capital of France is Paris.", add_special_tokens=False).input_ids
    assert tok.decode(ids) == "The capital of France is Paris."


def test_fp8_release_format(fp8_ckpt, ckpt_dir):
    cfg = json.loads((fp8_ckpt / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    meta = _dtypes(fp8_ckpt)
    n = cfg["num_hidden_layers"]
    fp8 = {k for k, (dt, _) in meta.items() if dt == "F8_E4M3"}
    for name in fp8:
        dt, shape = meta[name + "_scale_inv"]
        assert dt == "F32" and shape == (-(-meta[name][1][0] // 128), -(-meta[name][1][1] // 128))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in fp8
    assert "model.layers.0.self_attn.kv_b_proj.weight" in fp8 and "model.layers.0.mlp.down_proj.weight" in fp8
    partial = [k for k in fp8 if any(s > 128 and s % 128 for s in meta[k][1])]
    assert partial, "no FP8 tensor with a partial 128x128 block"
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"):
        assert meta[name][0] == "BF16", name
    assert meta["model.layers.1.mlp.gate.e_score_correction_bias"][0] == "F32"
    for extra in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head"):
        assert f"model.layers.{n}.{extra}.weight" in meta
    assert f"model.layers.{n}.mlp.experts.15.down_proj.weight" in fp8  # the MTP layer's own MoE
    assert f"model.layers.{n}.self_attn.o_proj.weight" in fp8
    # same tensor names as the BF16 release, plus the scales
    bf16 = set(_dtypes(ckpt_dir("deepseek_v3")))
    assert set(meta) == bf16 | {k + "_scale_inv" for k in fp8}


def test_same_seed_same_bytes_and_knobs(tmp_path):
    a = make_checkpoint("mixtral", tmp_path / "a", num_layers=1)
    b = make_checkpoint("mixtral", tmp_path / "b", num_layers=1)
    c = make_checkpoint("mixtral", tmp_path / "c", num_layers=1, seed=1)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    shard = max(a.glob("*.safetensors")).name
    assert (a / shard).read_bytes() != (c / shard).read_bytes()
    assert json.loads((a / "config.json").read_text())["num_hidden_layers"] == 1


def test_init_scale_makes_logits_peaked():
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        flat = make_model("qwen3_moe", num_layers=1)(ids).logits.softmax(-1).amax(-1).mean()
        peaked = make_model("qwen3_moe", num_layers=1, init_scale=30.0)(ids).logits.softmax(-1).amax(-1).mean()
    assert peaked > 0.5 > flat


def test_bad_arguments():
    with pytest.raises(ValueError, match="choose from"):
        make_model("llama")
    with pytest.raises(ValueError, match="deepseek_v3"):
        make_checkpoint("mixtral", "/nonexistent-never-written", fp8=True)
    assert set(ARCHS) == {"deepseek_v3", "mimo_v2_flash", "qwen3_moe", "mixtral", "deepseek_v2", "glm4_moe", "minimax_m2",
                          "deepseek_v32", "kimi_k25", "kimi_linear", "qwen3_next", "glm4_moe_lite", "gpt_oss",
                          "qwen3_5_moe",
                          "glm_moe_dsa", "longcat_flash", "deepseek_v4"}


def test_layers_and_dims_overrides(tmp_path):
    from ktconvert.sources import open_source

    d = make_checkpoint("deepseek_v3", tmp_path / "big", fp8=True, num_layers=4, hidden_size=160,
                        moe_intermediate_size=192, n_routed_experts=8)
    src = open_source(d)
    assert src.arch.moe_layers() == [1, 2, 3] and src.arch.n_experts == 8
    assert src.info("model.layers.3.mlp.experts.7.down_proj.weight").shape == (160, 192)
    assert src.arch.classify("model.layers.4.enorm.weight").kind == "skip"  # MTP moves with num_layers
    with pytest.raises(ValueError, match="no MoE layer"):
        make_checkpoint("deepseek_v2", tmp_path / "none", num_layers=1)
