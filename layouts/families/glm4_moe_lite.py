"""GLM-4.7-Flash (model_type glm4_moe_lite): DeepSeek-V3's multi-head latent attention (q LoRA, compressed-latent
KV, RoPE on interleaved pairs of the qk_rope_head_dim dims, rope_interleave) with GLM-4.5's MoE: sigmoid routing
with e_score_correction_bias and group-limited top-k (1 group in the release), routed_scaling_factor, one shared
expert, a dense first layer (transformers' mlp_layer_types, or first_k_dense_replace in the hub's config.json) and
a multi-token-prediction layer after the main ones (skipped). v_head_dim (256 in the release) differs from
qk_nope_head_dim (192).

Tensor names are DeepSeek-V3's (self_attn.q_a_proj / q_b_proj / kv_a_proj_with_mqa / kv_b_proj / o_proj,
mlp.gate, mlp.gate.e_score_correction_bias, mlp.shared_experts, mlp.experts.E.{gate,up,down}_proj), and so is the
math: ktrun runs it with DeepSeek-V3's forward. GGUF: llama.cpp's converter writes it as `deepseek2` (gguf-py has no
architecture of its own for it); the reader tells it from DeepSeek by the GLM pre-tokenizer or its NextN block
(deepseek_v2.is_glm4_moe_lite).
"""
from __future__ import annotations

from . import deepseek_v2
from .config import Fields, ModelConfig, rotary_dims
from .family import Family
from .hub_names import LAYER, HubNames

# attention_bias (false in the release, an option of transformers' class): q_a_proj, kv_a_proj_with_mqa and o_proj
# carry biases, kept in full precision beside their (possibly quantized) weights
ROWS = [(LAYER + r"self_attn\.(q_a_proj|kv_a_proj_with_mqa|o_proj)\.bias$", "attention", None)] + deepseek_v2.MLA_ROWS

# transformers Glm4MoeLiteConfig's defaults for the fields we read (its rope_theta is PreTrainedConfig's 10000)
DEFAULTS = {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 1.8, "n_shared_experts": 1, "q_lora_rank": 768, "max_position_embeddings": 202752,
            "num_key_value_heads": 20, "rms_norm_eps": 1e-5}


def parse(f: Fields) -> ModelConfig:
    # sigmoid + noaux_tc whatever scoring_func / topk_method say: transformers' GLM-4.5 router is the only one it has
    cfg = deepseek_v2.parse_mla(f, defaults=DEFAULTS, experts_alias="num_local_experts", scoring="sigmoid",
                                topk_method="noaux_tc", interleaved=bool(f.get("rope_interleave", True)), mtp=True)
    if cfg.qk_rope_head_dim is not None:    # the rope covers all qk_rope_head_dim dims (transformers' MLA needs it)
        rot = rotary_dims(f, cfg.qk_rope_head_dim, 1.0)
        f.check(rot == cfg.qk_rope_head_dim, f"field 'partial_rotary_factor' gives {rot} rotary dims of "
                                             f"qk_rope_head_dim={cfg.qk_rope_head_dim}; MLA ropes all of them (1.0)")
    return deepseek_v2.with_mlp_layer_types(f, cfg)


FAMILY = Family(
    name="glm4_moe_lite", title="GLM-4.7-Flash", architectures=("Glm4MoeLiteForCausalLM",), parse=parse,
    names=HubNames(ROWS, deepseek_v2.EXPERT_NAME, deepseek_v2.GATE_UP_DOWN, moe_prefix="mlp.",
                   shared_prefix="mlp.shared_experts.", mtp=True), gguf=deepseek_v2.GGUF)
