"""Release-shaped config.json files, no weights: the fields each release of GLM-4.5 / 4.5-Air / 4.6 / 4.7,
GLM-4.7-Flash, MiniMax-M2 / M2.1 / M2.5 / M2.7, DeepSeek-V3.2, Kimi-K2 and Kimi-K2.5 writes, with the values it
writes, read by ktlayouts.families (what the converter and ktrun read) and, independently, by transformers' own
config class of the family: both must read the same model.

Where the field sets come from (the releases' hub config.json files, as republished):
- GLM-4.7: as nvidia/GLM-4.7-NVFP4 republishes it (its NVFP4 quantization_config left out): GLM-4.6's fields and
  values, written by transformers 4.57 (`dtype`, not `torch_dtype`). GLM-4.6 and GLM-4.5 differ only in
  max_position_embeddings (202752 vs 131072); GLM-4.5-Air as transformers 4.54 loads it (no q/k norm, 128 experts,
  one dense layer, routed_scaling_factor 1.0).
- GLM-4.7-Flash: its config.json verbatim (written by transformers 5.0.0rc0: first_k_dense_replace, not
  mlp_layer_types; partial_rotary_factor 1.0).
- MiniMax-M2 / M2.1 / M2.5: one field set (max_position_embeddings 196608, rotary_dim 64, use_mtp with 3 modules of 1
  layer, FP8 e4m3 128x128 blocks with the router, its bias and lm_head unconverted); M2.7: 204800 positions, `dtype`.
- DeepSeek-V3.2: verbatim (FP8 with scale_fmt ue8m0, index_topk 2048). Kimi-K2-Instruct: verbatim (model_type
  kimi_k2, rope_theta 50000, YaRN factor 32 with beta_fast 1, 131072 positions, no MTP layer). Kimi-K2.5: as its
  remote-code config class serializes it (architectures KimiK25ForConditionalGeneration, the text model under
  text_config with YaRN factor 64 and 262144 positions, compressed-tensors int4 both at the top and in text_config).
"""
from __future__ import annotations

import pytest
from ktlayouts.families import parse_config

from ktconvert.sources.roles import adapter_for

_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
_GLM_EOS = [151329, 151336, 151338]

GLM47 = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "dtype": "bfloat16",
         "eos_token_id": _GLM_EOS, "first_k_dense_replace": 3, "head_dim": 128, "hidden_act": "silu",
         "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 202752,
         "model_type": "glm4_moe", "moe_intermediate_size": 1536, "n_group": 1, "n_routed_experts": 160,
         "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
         "num_hidden_layers": 92, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "pad_token_id": 151329,
         "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
         "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 1,
         "transformers_version": "4.57.1", "use_cache": True, "use_qk_norm": True, "vocab_size": 151552}
GLM45 = {**{k: v for k, v in GLM47.items() if k != "dtype"}, "max_position_embeddings": 131072,
         "torch_dtype": "bfloat16", "transformers_version": "4.54.0"}
GLM45_AIR = {**GLM45, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
             "n_routed_experts": 128, "first_k_dense_replace": 1, "num_hidden_layers": 46, "routed_scaling_factor": 1.0,
             "use_qk_norm": False, "transformers_version": "4.54.1"}
GLM47_FLASH = {"architectures": ["Glm4MoeLiteForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "pad_token_id": 154820, "eos_token_id": [154820, 154827, 154829], "hidden_act": "silu",
               "hidden_size": 2048, "intermediate_size": 10240, "max_position_embeddings": 202752,
               "model_type": "glm4_moe_lite", "moe_intermediate_size": 1536, "topk_method": "noaux_tc",
               "norm_topk_prob": True, "num_attention_heads": 20, "n_group": 1, "topk_group": 1,
               "n_routed_experts": 64, "n_shared_experts": 1, "routed_scaling_factor": 1.8, "num_experts_per_tok": 4,
               "first_k_dense_replace": 1, "num_hidden_layers": 47, "num_key_value_heads": 20,
               "num_nextn_predict_layers": 1, "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-05,
               "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False, "dtype": "bfloat16",
               "transformers_version": "5.0.0rc0", "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
               "qk_rope_head_dim": 64, "v_head_dim": 256, "vocab_size": 154880}
MINIMAX_M2 = {"architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1] * 62,
              "auto_map": {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
                           "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM"},
              "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
              "max_position_embeddings": 196608, "model_type": "minimax_m2", "mtp_transformer_layers": 1,
              "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
              "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer",
              "quantization_config": {**_FP8, "fmt": "float8_e4m3fn",
                                      "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
              "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64, "scoring_func": "sigmoid",
              "shared_intermediate_size": 0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.46.1", "use_cache": True, "use_mtp": True, "use_qk_norm": True,
              "use_routing_bias": True, "vocab_size": 200064}
MINIMAX_M27 = {**{k: v for k, v in MINIMAX_M2.items() if k != "torch_dtype"}, "dtype": "bfloat16",
               "max_position_embeddings": 204800}
_DSV3_MLA = {"attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 7168,
             "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "moe_intermediate_size": 2048,
             "moe_layer_freq": 1, "n_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 8,
             "num_hidden_layers": 61, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
             "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_method": "noaux_tc",
             "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128}
DSV32 = {**_DSV3_MLA, "architectures": ["DeepseekV32ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
         "first_k_dense_replace": 3, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
         "max_position_embeddings": 163840, "model_type": "deepseek_v32", "n_group": 8, "n_routed_experts": 256,
         "num_attention_heads": 128, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
         "quantization_config": {**_FP8, "scale_fmt": "ue8m0"}, "rms_norm_eps": 1e-06,
         "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096, "type": "yarn"},
         "rope_theta": 10000, "routed_scaling_factor": 2.5, "topk_group": 4, "transformers_version": "4.44.2",
         "vocab_size": 129280}
KIMI_K2 = {**_DSV3_MLA, "architectures": ["DeepseekV3ForCausalLM"],
           "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                        "AutoModel": "modeling_deepseek.DeepseekV3Model",
                        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
           "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
           "max_position_embeddings": 131072, "model_type": "kimi_k2", "n_group": 1, "n_routed_experts": 384,
           "num_attention_heads": 64, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "pretraining_tp": 1,
           "quantization_config": _FP8, "rms_norm_eps": 1e-06, "rope_theta": 50000.0, "routed_scaling_factor": 2.827,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "seq_aux": True, "topk_group": 1, "transformers_version": "4.48.3", "vocab_size": 163840}
_CT_INT4 = {"config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                          "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                                      "group_size": 32, "num_bits": 4, "observer": "minmax",
                                                      "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                                      "type": "int"}}},
            "format": "pack-quantized", "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]}
KIMI_K25 = {"architectures": ["KimiK25ForConditionalGeneration"],
            "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                         "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                         "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
            "bos_token_id": 163584, "dtype": "bfloat16", "eos_token_id": 163585, "ignore_index": -100,
            "media_placeholder_token_id": 163605, "model_type": "kimi_k25", "pad_token_id": 163839,
            "quantization_config": _CT_INT4, "tie_word_embeddings": False, "use_unified_vision_chunk": True,
            "video_placeholder": "<|kimi_k25_video_placeholder|>",
            "text_config": {**{k: v for k, v in KIMI_K2.items() if k not in ("transformers_version", "torch_dtype")},
                            "model_type": "deepseek_v3", "dtype": "bfloat16", "ep_size": 1,
                            "max_position_embeddings": 262144, "pad_token_id": 163839,
                            "quantization_config": _CT_INT4,
                            "rope_scaling": {**KIMI_K2["rope_scaling"], "beta_fast": 32.0, "factor": 64.0}},
            "vision_config": {"init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64,
                              "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": 1152,
                              "mm_projector_type": "patchmerger", "model_type": "", "patch_size": 14,
                              "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu",
                              "projector_ln_eps": 1e-05, "text_hidden_size": 7168,
                              "video_attn_type": "spatial_temporal", "vt_hidden_size": 1152,
                              "vt_intermediate_size": 4304, "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27}}

_GLM_WANT = {"model_type": "glm4_moe", "num_layers": 92, "num_experts": 160, "top_k": 8, "moe_layers": tuple(range(3, 92)),
             "n_mtp_layers": 1, "head_dim": 128, "num_heads": 96, "num_kv_heads": 8, "qk_norm": True,
             "attention_bias": True, "routed_scaling_factor": 2.5, "scoring": "sigmoid", "rope_dims": 64,
             "rope_theta": 1e6, "rope_kind": "default", "rms_norm_eps": 1e-5, "eos_token_ids": tuple(_GLM_EOS)}
RELEASES = {
    "GLM-4.7": (GLM47, {**_GLM_WANT, "max_position": 202752}),
    "GLM-4.6": (GLM45 | {"max_position_embeddings": 202752}, {**_GLM_WANT, "max_position": 202752}),
    "GLM-4.5": (GLM45, {**_GLM_WANT, "max_position": 131072}),
    "GLM-4.5-Air": (GLM45_AIR, {"num_layers": 46, "num_experts": 128, "moe_layers": tuple(range(1, 46)), "qk_norm": False,
                                "attention_bias": True, "routed_scaling_factor": 1.0, "moe_intermediate_size": 1408,
                                "intermediate_size": 10944, "n_mtp_layers": 1, "rope_dims": 64}),
    "GLM-4.7-Flash": (GLM47_FLASH, {"model_type": "glm4_moe_lite", "attention": "mla", "num_layers": 47,
                                    "num_experts": 64, "top_k": 4, "moe_layers": tuple(range(1, 47)), "n_mtp_layers": 1,
                                    "v_head_dim": 256, "qk_nope_head_dim": 192, "q_lora_rank": 768, "rope_dims": 64,
                                    "rope_theta": 1e6, "routed_scaling_factor": 1.8, "rms_norm_eps": 1e-5,
                                    "scoring": "sigmoid", "max_position": 202752,
                                    "eos_token_ids": (154820, 154827, 154829)}),
    "MiniMax-M2": (MINIMAX_M2, {"model_type": "minimax_m2", "num_layers": 62, "num_experts": 256, "top_k": 8,
                                "moe_layers": tuple(range(62)), "moe_intermediate_size": 1536, "n_shared_experts": 0,
                                "qk_norm": True, "qk_norm_scope": "projection", "rope_dims": 64, "rope_theta": 5e6,
                                "norm_topk_prob": True, "n_mtp_layers": 3, "max_position": 196608,
                                "eos_token_ids": ()}),                  # EOS: generation_config.json / tokenizer
    "MiniMax-M2.7": (MINIMAX_M27, {"num_layers": 62, "rope_dims": 64, "max_position": 204800, "n_mtp_layers": 3}),
    "DeepSeek-V3.2": (DSV32, {"model_type": "deepseek_v32", "index_topk": 2048, "index_n_heads": 64,
                              "index_head_dim": 128, "moe_layers": tuple(range(3, 61)), "n_group": 8, "topk_group": 4,
                              "rope_kind": "yarn", "rope_factor": 40.0, "rope_beta_fast": 32.0, "n_mtp_layers": 1,
                              "eos_token_ids": (1,)}),
    "Kimi-K2": (KIMI_K2, {"model_type": "deepseek_v3", "num_experts": 384, "num_heads": 64, "n_group": 1,
                          "moe_layers": tuple(range(1, 61)), "routed_scaling_factor": 2.827, "rope_kind": "yarn",
                          "rope_theta": 5e4, "rope_factor": 32.0, "rope_beta_fast": 1.0, "max_position": 131072,
                          "n_mtp_layers": 0, "eos_token_ids": (163585,)}),
    "Kimi-K2.5": (KIMI_K25, {"model_type": "kimi_k25", "num_experts": 384, "num_heads": 64,
                             "moe_layers": tuple(range(1, 61)), "rope_theta": 5e4, "rope_factor": 64.0,
                             "rope_beta_fast": 32.0, "max_position": 262144, "eos_token_ids": (163585,)}),
}
_ROPE = {"rope_dims": "dim", "rope_theta": "theta", "rope_kind": "kind", "rope_factor": "factor",
         "rope_beta_fast": "beta_fast"}


@pytest.mark.parametrize("release", RELEASES)
def test_release_config_parses(release):
    raw, want = RELEASES[release]
    cfg = parse_config(raw)
    got = {k: getattr(cfg, k) for k in want if k not in _ROPE}
    got.update({k: getattr(cfg.rope, attr) for k, attr in _ROPE.items() if k in want})
    assert got == want
    assert adapter_for(raw).moe_layers() == list(cfg.moe_layers)      # the converter reads it the same way


def _head_dim(c) -> int:
    """head_dim as transformers' GQA attention takes it: the field, else hidden_size / heads."""
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _transformers_reading(raw: dict) -> dict:
    """What transformers' config class of the family (built from raw, as from_pretrained builds it) says about the
    fields both read: sizes, routing, rope, MoE layers."""
    from transformers import CONFIG_MAPPING
    mt = {"kimi_k2": "deepseek_v3"}.get(raw["model_type"], raw["model_type"])
    c = CONFIG_MAPPING[mt](**{k: v for k, v in raw.items() if k != "model_type"})
    c = c.get_text_config()
    rp = c.rope_parameters
    experts = getattr(c, "n_routed_experts", None) or c.num_local_experts
    mla = getattr(c, "kv_lora_rank", None) is not None
    if getattr(c, "mlp_layer_types", None) is not None:
        moe = tuple(i for i, t in enumerate(c.mlp_layer_types) if t == "sparse")
    else:
        moe = tuple(range(getattr(c, "first_k_dense_replace", 0), c.num_hidden_layers))
    out = {"num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "num_experts": experts,
           "top_k": c.num_experts_per_tok, "moe_layers": moe, "num_heads": c.num_attention_heads,
           "max_position": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": float(rp["rope_theta"]), "rope_kind": rp.get("rope_type", "default"),
           "rope_dims": c.qk_rope_head_dim if mla else int(_head_dim(c) * rp.get("partial_rotary_factor", 1.0))}
    if out["rope_kind"] == "yarn":
        out |= {"rope_factor": float(rp["factor"]), "rope_beta_fast": float(rp["beta_fast"])}
    for ours, theirs in (("routed_scaling_factor", "routed_scaling_factor"), ("n_group", "n_group"),
                         ("topk_group", "topk_group"), ("qk_norm", "use_qk_norm"), ("num_kv_heads", None),
                         ("index_topk", "index_topk"), ("v_head_dim", "v_head_dim")):
        if ours == "num_kv_heads" and not mla:
            out[ours] = c.num_key_value_heads
        elif theirs and getattr(c, theirs, None) is not None:
            out[ours] = getattr(c, theirs)
    return out


@pytest.mark.parametrize("release", RELEASES)
def test_release_config_reads_as_transformers_reads_it(release):
    raw, _ = RELEASES[release]
    cfg = parse_config(raw)
    theirs = _transformers_reading(raw)
    ours = {k: getattr(cfg, k) for k in theirs if k not in _ROPE}
    ours.update({k: getattr(cfg.rope, attr) for k, attr in _ROPE.items() if k in theirs})
    assert ours == theirs

