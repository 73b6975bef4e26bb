"""The shipped default model's config.json is hub-faithful: the key set and spellings of deepseek-ai/DeepSeek-V3's
config.json, no transformers-only keys, and values every DeepSeek-V3 reader maps to the model as trained (sigmoid
scores with e_score_correction_bias, noaux_tc group-limited routing, rope written as YaRN factor 1 = plain rope).

References: the key list of the published deepseek-ai/DeepSeek-V3 config.json (written out below, from the hub
file), transformers' DeepseekV3Config (an independent reader: the keys it knows must be spelled as the hub spells
them) and transformers' model (logits with the shipped config equal those with plain rope).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ktconvert

MODEL_DIR = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"

# Every top-level key of deepseek-ai/DeepSeek-V3's config.json (hub revision of the V3 release).
DEEPSEEK_V3_HUB_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "auto_map", "aux_loss_alpha", "bos_token_id",
    "eos_token_id", "ep_size", "first_k_dense_replace", "hidden_act", "hidden_size", "initializer_range",
    "intermediate_size", "kv_lora_rank", "max_position_embeddings", "model_type", "moe_intermediate_size",
    "moe_layer_freq", "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads",
    "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_nextn_predict_layers", "pretraining_tp",
    "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "quantization_config", "rms_norm_eps", "rope_scaling",
    "rope_theta", "routed_scaling_factor", "scoring_func", "seq_aux", "tie_word_embeddings", "topk_group",
    "topk_method", "torch_dtype", "transformers_version", "use_cache", "v_head_dim", "vocab_size",
}
# Hub keys the default model leaves out, and why.
NOT_SHIPPED = {"auto_map": "remote code: never shipped, never run",
               "quantization_config": "the weights are BF16, not DeepSeek's FP8"}
# Hub keys that only DeepSeek's remote-code config class defines (transformers' DeepseekV3Config does not).
REMOTE_CODE_ONLY = {"aux_loss_alpha", "ep_size", "moe_layer_freq", "scoring_func", "seq_aux", "topk_method"}
# Hub keys transformers turns into something else when it loads them.
RENAMED_BY_TRANSFORMERS = {"rope_scaling", "rope_theta", "torch_dtype"}   # -> rope_parameters, dtype


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((MODEL_DIR / "config.json").read_text())


def test_every_deepseek_v3_hub_key_is_present(config):
    missing = DEEPSEEK_V3_HUB_KEYS - set(NOT_SHIPPED) - set(config)
    assert not missing, f"config.json lacks DeepSeek-V3 hub keys {sorted(missing)}"


def test_no_keys_the_hub_does_not_have(config):
    extra = set(config) - DEEPSEEK_V3_HUB_KEYS
    assert not extra, f"config.json has keys the hub's DeepSeek-V3 config does not (transformers-only?): {sorted(extra)}"
    assert not set(NOT_SHIPPED) & set(config)


def test_routing_and_rope_as_deepseek_v3_readers_expect(config):
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["scoring_func"] == "sigmoid" and config["topk_method"] == "noaux_tc"   # llama.cpp: gating func
    assert config["n_routed_experts"] % config["n_group"] == 0 and 0 < config["topk_group"] <= config["n_group"]
    assert config["norm_topk_prob"] is True and config["routed_scaling_factor"] == 2.5
    rs = config["rope_scaling"]
    assert rs["type"] == "yarn" and rs["factor"] == 1.0                                   # YaRN factor 1: plain rope
    assert rs["original_max_position_embeddings"] == config["max_position_embeddings"]   # transformers' ratio rule
    assert config["torch_dtype"] == "bfloat16" and isinstance(config["rope_theta"], float)


def test_transformers_reads_the_hub_spellings(config):
    """Every hub key is a field of transformers' DeepseekV3Config, except DeepSeek's remote-code fields and the ones
    transformers renames on load (so the key list above is spelled right), and transformers reads our values."""
    from transformers import DeepseekV3Config

    reference = DeepseekV3Config()
    unknown = {k for k in DEEPSEEK_V3_HUB_KEYS if not hasattr(reference, k)}
    assert unknown - set(NOT_SHIPPED) == REMOTE_CODE_ONLY | {"rope_theta"}    # rope_theta: into rope_parameters
    cfg = DeepseekV3Config.from_pretrained(str(MODEL_DIR))
    for k in DEEPSEEK_V3_HUB_KEYS - unknown - RENAMED_BY_TRANSFORMERS - {"transformers_version"}:
        assert getattr(cfg, k) == config[k], k
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["rope_theta"] == config["rope_theta"]


def test_ktrun_parses_sigmoid_noaux_tc_routing():
    from ktlayouts.families import load_config

    c = load_config(MODEL_DIR / "config.json")
    assert (c.scoring, c.topk_method, c.n_group, c.topk_group) == ("sigmoid", "noaux_tc", 4, 2)
    assert c.rope.kind == "yarn" and c.rope.factor == 1.0 and c.softmax_scale == pytest.approx(96 ** -0.5)


@torch.no_grad()
def test_yarn_factor_one_is_the_plain_rope_the_model_was_trained_with():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    shipped = DeepseekV3ForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    plain_cfg = DeepseekV3Config.from_pretrained(str(MODEL_DIR))
    plain_cfg.rope_parameters = {"rope_type": "default", "rope_theta": plain_cfg.rope_parameters["rope_theta"]}
    plain = DeepseekV3ForCausalLM.from_pretrained(str(MODEL_DIR), config=plain_cfg, dtype=torch.float32).eval()
    x = torch.randint(5, shipped.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0))
    a, b = shipped(input_ids=x).logits, plain(input_ids=x).logits
    assert float((a - b).abs().max()) < 1e-4 * float(b.abs().max())
