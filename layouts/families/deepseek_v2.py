"""DeepSeek-V2 (and V2-Lite): MLA attention (q/kv LoRA, RoPE on interleaved pairs, compressed-latent cache), softmax
routing with greedy or group_limited_greedy top-k, routed_scaling_factor, shared experts, first_k_dense_replace
dense layers. GGUF: llama.cpp's `deepseek2`, which V3 / Kimi-K2 share (the gating function tells them apart).

The MLA tensor names, the dense-first MoE rule and the `deepseek2` GGUF architecture defined here are DeepSeek-V3's
too (deepseek_v3.py imports them).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .config import Fields, ModelConfig, check_routing, parse_rope, token_ids
from .family import Family
from .gguf_names import (
    ATTN_NORM_ROWS,
    DENSE_MLP_ROWS,
    GLOBAL_ROWS,
    HUB_GATE_UP_DOWN,
    NEXTN_ROW,
    GGUFArch,
    Join,
    expert_rows,
)
from .hub_names import COMMON_ROWS, GATE_UP_DOWN, LAYER, HubNames

# --- hub tensor names ------------------------------------------------------------------------------------------
MLA_ROWS = COMMON_ROWS + [
    (LAYER + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$", "expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.gate\.weight$", "router", None),
    (LAYER + r"mlp\.gate\.e_score_correction_bias$", "router_bias", None),
    (LAYER + r"mlp\.shared_experts\.(?P<proj>gate|up|down)_proj\.weight$", "shared_expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.(?P<proj>gate|up|down)_proj\.weight$", "dense_mlp", GATE_UP_DOWN),
    (LAYER + r"self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight$", "norm", None),
    (LAYER + r"self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight$", "attention", None),
]
EXPERT_NAME = "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


def hub_names(mtp: bool) -> HubNames:
    return HubNames(MLA_ROWS, EXPERT_NAME, GATE_UP_DOWN, moe_prefix="mlp.", shared_prefix="mlp.shared_experts.",
                    mtp=mtp)


# --- config.json -----------------------------------------------------------------------------------------------
def dense_first_moe_layers(n_layers: int, n_experts: int, first_dense: int, freq: int) -> tuple[int, ...]:
    """DeepSeek's rule: layers >= first_k_dense_replace (every moe_layer_freq-th) are MoE."""
    return tuple(i for i in range(n_layers) if n_experts and i >= first_dense and i % freq == 0)


def parse_mla(f: Fields, *, defaults: dict, experts_alias: str, scoring: str, topk_method: str,
              interleaved: bool, mtp: bool) -> ModelConfig:
    """The config of an MLA family; `defaults` are its transformers config class's defaults."""
    n_layers, hidden = f.need("num_hidden_layers"), f.need("hidden_size")
    n_experts = f.need("n_routed_experts", experts_alias)
    top_k = f.need("num_experts_per_tok")
    n_group = f.get("n_group", defaults["n_group"], cast=int) or 1
    topk_group = f.get("topk_group", defaults["topk_group"], cast=int) or 1
    grouped = topk_method in ("group_limited_greedy", "noaux_tc")
    if topk_method == "group_limited_greedy":
        f.check(f.raw.get("n_group") is not None, "topk_method 'group_limited_greedy' needs field 'n_group'")
    check_routing(f, n_experts, top_k, n_group, topk_group, grouped=grouped, sigmoid_groups=scoring == "sigmoid")
    first_dense = f.get("first_k_dense_replace", defaults["first_k_dense_replace"], cast=int)
    nh = f.run("num_attention_heads")
    rope_dim = f.run("qk_rope_head_dim")
    max_position = f.get("max_position_embeddings", defaults["max_position_embeddings"], cast=int)
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=f.need("moe_intermediate_size"),
        moe_layers=dense_first_moe_layers(n_layers, n_experts, first_dense, f.get("moe_layer_freq", 1, cast=int)),
        attention="mla", vocab_size=f.run("vocab_size"), num_heads=nh,
        num_kv_heads=f.get("num_key_value_heads", defaults["num_key_value_heads"] or nh, cast=int),  # unused by MLA
        head_dim=rope_dim,
        intermediate_size=f.run("intermediate_size"),
        rope=parse_rope(f, rope_dim, 10000.0, max_position, interleaved),
        rms_norm_eps=f.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6), cast=float), max_position=max_position,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", False)),
        n_shared_experts=f.get("n_shared_experts", defaults["n_shared_experts"], cast=int),
        first_k_dense=first_dense,
        n_mtp_layers=f.get("num_nextn_predict_layers", 1, cast=int) if mtp else 0,
        norm_topk_prob=bool(f.get("norm_topk_prob", defaults["norm_topk_prob"])),
        routed_scaling_factor=f.get("routed_scaling_factor", defaults["routed_scaling_factor"], cast=float),
        scoring=scoring, topk_method=topk_method, n_group=n_group, topk_group=topk_group,
        q_lora_rank=f.get("q_lora_rank", defaults["q_lora_rank"], cast=int, keep_null=True),
        kv_lora_rank=f.run("kv_lora_rank"), qk_nope_head_dim=f.run("qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
        v_head_dim=f.run("v_head_dim"), bos_token_id=f.raw.get("bos_token_id"),
        eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw)


def with_mlp_layer_types(f: Fields, cfg: ModelConfig) -> ModelConfig:
    """transformers' explicit form of first_k_dense_replace (DeepSeek-V3.2, GLM-4.7-Flash): `mlp_layer_types`,
    "dense" | "sparse" per layer, decides which layers are MoE when config.json has it."""
    types = f.get("mlp_layer_types", None)
    if types is None:
        return cfg
    f.check(isinstance(types, list) and len(types) == cfg.num_layers and set(types) <= {"dense", "sparse"},
            f"mlp_layer_types must list 'dense' or 'sparse' for each of num_hidden_layers={cfg.num_layers} layers")
    return dataclasses.replace(cfg, moe_layers=tuple(i for i, t in enumerate(types) if t == "sparse"
                                                    and cfg.num_experts))


# transformers DeepseekV2Config's defaults for the fields we read
DEFAULTS = {"first_k_dense_replace": 0, "n_group": None, "topk_group": None, "norm_topk_prob": False,
            "routed_scaling_factor": 1.0, "n_shared_experts": 2, "q_lora_rank": 1536, "max_position_embeddings": 2048,
            "topk_method": "greedy", "num_key_value_heads": None}


def parse(f: Fields) -> ModelConfig:
    method = f.get("topk_method", DEFAULTS["topk_method"])
    f.check(method in ("greedy", "group_limited_greedy"),
            f"topk_method {method!r} is not one of 'greedy', 'group_limited_greedy'")
    # transformers' DeepSeek-V2 router: logits in float32, and norm_topk_prob read nowhere
    return dataclasses.replace(
        parse_mla(f, defaults=DEFAULTS, experts_alias="num_experts", scoring="softmax", topk_method=method,
                  interleaved=True, mtp=False), router_float32=True, router_renormalizes=False)


# --- GGUF: llama.cpp's "deepseek2" (DeepSeek-V2, V3, Kimi-K2, and GLM-4.7-Flash) ---------------------------------
def _kv_b_shape(parts: dict, cfg: dict) -> tuple:
    heads, rank, nope = parts["k_b"]
    return (heads * (nope + parts["v_b"][1]), rank)


def _kv_b(parts: dict, cfg: dict):
    """attn_k_b (heads, kv_rank, nope) + attn_v_b (heads, v, kv_rank) -> kv_b_proj (heads * (nope + v), kv_rank):
    newer llama.cpp converters split kv_b_proj per head and transpose its k part for MLA's absorbed form."""
    k_b, v_b = parts["k_b"], parts["v_b"]
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(_kv_b_shape(
        {"k_b": k_b.shape, "v_b": v_b.shape}, cfg))


KV_B = Join(("k_b", "v_b"), _kv_b_shape, _kv_b)
_DEEPSEEK2_ROWS = GLOBAL_ROWS + ATTN_NORM_ROWS + DENSE_MLP_ROWS + expert_rows("mlp", HUB_GATE_UP_DOWN) + [
    (r"blk\.(?P<L>\d+)\.attn_q\.weight", "model.layers.{L}.self_attn.q_proj.weight"),
    (r"blk\.(?P<L>\d+)\.attn_q_a\.weight", "model.layers.{L}.self_attn.q_a_proj.weight"),
    (r"blk\.(?P<L>\d+)\.attn_q_a_norm\.weight", "model.layers.{L}.self_attn.q_a_layernorm.weight"),
    (r"blk\.(?P<L>\d+)\.attn_q_b\.weight", "model.layers.{L}.self_attn.q_b_proj.weight"),
    (r"blk\.(?P<L>\d+)\.attn_kv_a_mqa\.weight", "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight"),
    (r"blk\.(?P<L>\d+)\.attn_kv_a_norm\.weight", "model.layers.{L}.self_attn.kv_a_layernorm.weight"),
    (r"blk\.(?P<L>\d+)\.attn_kv_b\.weight", "model.layers.{L}.self_attn.kv_b_proj.weight"),
    (r"blk\.(?P<L>\d+)\.attn_k_b\.weight", "model.layers.{L}.self_attn.kv_b_proj.weight", KV_B, "k_b"),
    (r"blk\.(?P<L>\d+)\.attn_v_b\.weight", "model.layers.{L}.self_attn.kv_b_proj.weight", KV_B, "v_b"),
    (r"blk\.(?P<L>\d+)\.attn_output\.weight", "model.layers.{L}.self_attn.o_proj.weight"),
    (r"blk\.(?P<L>\d+)\.ffn_gate_inp\.weight", "model.layers.{L}.mlp.gate.weight"),
    (r"blk\.(?P<L>\d+)\.exp_probs_b\.bias", "model.layers.{L}.mlp.gate.e_score_correction_bias"),
    NEXTN_ROW,
] + [(rf"blk\.(?P<L>\d+)\.ffn_{p}_shexp\.weight", f"model.layers.{{L}}.mlp.shared_experts.{p}_proj.weight")
     for p in ("gate", "up", "down")]


# GLM-4.7-Flash (glm4_moe_lite): llama.cpp's Glm4MoeLiteModel writes it as deepseek2, told apart by what its converter
# adds: the GLM tokenizer's pre-tokenizer ("glm4"; DeepSeek / Kimi GGUFs carry their own) and its NextN block
# (nextn_predict_layers; DeepseekV2Model drops MTP layers). Its config has no scoring_func, so no expert_gating_func
# is written: the score-correction bias (exp_probs_b) says sigmoid, as for DeepSeek-V3 GGUFs of older converters.
GLM_PRE_TOKENIZERS = ("glm4",)


def is_glm4_moe_lite(m) -> bool:
    return m.a("nextn_predict_layers", 0) > 0 or m.get("tokenizer.ggml.pre", None) in GLM_PRE_TOKENIZERS


def _deepseek2_config(m, cfg: dict, names: frozenset) -> dict:
    # DeepSeek-V3 / Kimi-K2: sigmoid gating (expert_gating_func 2) with a score-correction bias; V2: softmax (1).
    has_exp_probs_b = any(n.endswith("exp_probs_b.bias") for n in names)
    gating = m.a("expert_gating_func", 0)
    sigmoid = gating == 2 or (gating == 0 and has_exp_probs_b)
    glm = sigmoid and is_glm4_moe_lite(m)
    n_mtp = m.a("nextn_predict_layers", 0)
    nope_rope = m.a("attention.key_length_mla", None) or m.a("attention.key_length")
    rope_dim = m.a("rope.dimension_count")
    q_lora = m.a("attention.q_lora_rank", 0) or None
    model_type, arch = (("glm4_moe_lite", "Glm4MoeLiteForCausalLM") if glm else
                        ("deepseek_v3", "DeepseekV3ForCausalLM") if sigmoid else
                        ("deepseek_v2", "DeepseekV2ForCausalLM"))
    cfg.update({
        "model_type": model_type, "architectures": [arch],
        "num_hidden_layers": cfg["num_hidden_layers"] - n_mtp,       # llama.cpp counts the NextN blocks too
        "num_nextn_predict_layers": n_mtp,
        "num_key_value_heads": cfg["num_attention_heads"],            # llama.cpp writes MLA as 1 KV head (MQA)
        "intermediate_size": m.a("feed_forward_length"),
        "moe_intermediate_size": m.a("expert_feed_forward_length"),
        "n_routed_experts": m.a("expert_count"),
        "num_experts_per_tok": m.a("expert_used_count"),
        "n_shared_experts": m.a("expert_shared_count", 0),
        "first_k_dense_replace": m.a("leading_dense_block_count", 0),
        "routed_scaling_factor": m.a("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(m.a("expert_weights_norm", False)),
        "n_group": m.a("expert_group_count", 1) or 1,
        "topk_group": m.a("expert_group_used_count", 1) or 1,
        "q_lora_rank": q_lora,
        "kv_lora_rank": m.a("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": nope_rope - rope_dim,
        "v_head_dim": m.a("attention.value_length_mla", None) or m.a("attention.value_length"),
        "moe_layer_freq": 1,
    })
    if glm:
        cfg["rope_interleave"] = True       # GLM-4.7-Flash's MLA ropes interleaved pairs, as llama.cpp's deepseek2
    cfg["topk_method"] = "noaux_tc" if sigmoid else ("group_limited_greedy" if cfg["n_group"] > 1 else "greedy")
    if sigmoid:
        cfg["scoring_func"] = "sigmoid"
    if m.a("rope.scaling.type", "none") == "yarn":
        cfg["rope_scaling"] = {
            "type": "yarn", "rope_type": "yarn", "factor": m.a("rope.scaling.factor"),
            "original_max_position_embeddings": m.a("rope.scaling.original_context_length"),
            "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": m.a("rope.scaling.yarn_log_multiplier", 0.0) / 0.1,
        }
    return cfg


GGUF = GGUFArch("deepseek2", _DEEPSEEK2_ROWS, _deepseek2_config)

FAMILY = Family(
    name="deepseek_v2", title="DeepSeek-V2", architectures=("DeepseekV2ForCausalLM",), parse=parse,
    names=hub_names(mtp=False), gguf=GGUF)
