"""One fixture entry per model family: how the checkpoint factory builds a tiny hub-layout checkpoint of it.

Everything here describes the hub's files independently of the converter's registry (ktlayouts.families), so the
fixtures test the registry rather than repeat it: tiny dimensions for the transformers config class, the config.json
keys the hub carries beyond what transformers writes, how the hub names the MoE block and expert projections, and the
tokenizer style. tests/test_families.py checks that every registered family has an entry here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

HUB_GATE_UP_DOWN = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class FixtureFamily:
    config: dict                                    # tiny dimensions for the transformers config class
    tokenizer: str                                  # ktconvert.testing.tokenizer.STYLES key
    hub_extra_keys: dict = field(default_factory=dict)    # config.json keys transformers does not write
    hub_key_renames: dict = field(default_factory=dict)   # transformers to_dict() key -> the hub's key
    hub_drop_keys: tuple = ()                       # keys transformers writes that the hub's config lacks
    moe_block: str = "mlp"                          # hub name of the MoE block (router + experts) in a layer
    expert_projs: dict = field(default_factory=lambda: dict(HUB_GATE_UP_DOWN))  # gate/up/down -> hub token
    fp8: bool = False                               # also released in DeepSeek's FP8 block format
    mtp: bool = False                               # hub checkpoints carry a multi-token-prediction layer


# Tiny dimensions that still exercise padding: expert sizes not multiples of 64, FP8 dims > 128 and not
# multiples of 128 (partial blocks), dense layers before MoE layers, shared experts.
FIXTURES = {
    "deepseek_v3": FixtureFamily(
        config={
            "hidden_size": 96, "intermediate_size": 200, "moe_intermediate_size": 160, "n_routed_experts": 16,
            "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
            "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
            "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 1},
        tokenizer="deepseek",
        hub_extra_keys={"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "ep_size": 1},
        hub_drop_keys=("head_dim",), fp8=True, mtp=True),
    "qwen3_moe": FixtureFamily(
        config={
            "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 80, "num_experts": 8,
            "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "norm_topk_prob": True, "max_position_embeddings": 1024, "bos_token_id": 0,
            "eos_token_id": 2},
        tokenizer="chatml", hub_key_renames={"num_local_experts": "num_experts"}),
    "mixtral": FixtureFamily(
        config={
            "hidden_size": 96, "intermediate_size": 160, "num_local_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2},
        tokenizer="mistral", moe_block="block_sparse_moe", expert_projs={"gate": "w1", "up": "w3", "down": "w2"}),
    "deepseek_v2": FixtureFamily(
        config={
            "hidden_size": 128, "intermediate_size": 224, "moe_intermediate_size": 80, "n_routed_experts": 8,
            "num_experts_per_tok": 3, "n_group": 1, "topk_group": 1, "topk_method": "greedy", "n_shared_experts": 2,
            "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
            "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
            "v_head_dim": 32, "routed_scaling_factor": 1.0, "norm_topk_prob": False, "max_position_embeddings": 1024,
            "bos_token_id": 0, "eos_token_id": 1},
        tokenizer="deepseek",
        hub_extra_keys={"moe_layer_freq": 1, "scoring_func": "softmax", "ep_size": 1, "aux_loss_alpha": 0.001},
        hub_drop_keys=("head_dim",)),
}
ARCHS = tuple(FIXTURES)
