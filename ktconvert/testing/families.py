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
    fp8_config: dict = field(default_factory=dict)  # the release's quantization_config keys beyond DeepSeek's
    mtp: bool = False                               # hub checkpoints carry a multi-token-prediction layer
    model_class: str = "AutoModelForCausalLM"       # transformers class (or auto class) that builds the model
    architecture: str | None = None                 # config.json architectures[0] when not <Config>ForCausalLM
    text_config_key: str | None = None              # the text model's config sits under this key (Kimi-K2.5)
    text_prefix: str = ""                           # the hub names the text model's tensors under this prefix
    partial_rotary_key: str | None = None           # how the hub writes partial rotary: "partial_rotary_factor"
                                                    # (GLM) or "rotary_dim" (MiniMax-M2), at the top level
    vocab_size: int = 320                           # the model's vocabulary (past the tokenizer's, as on the hub)
    fused_experts: bool = False                     # the hub keeps transformers' fused expert tensors (gpt-oss)
    mxfp4: bool = False                             # also released with MXFP4 experts (gpt-oss's quant_method mxfp4)
    random_biases: bool = False                     # transformers inits the biases (and sinks) to zero: randomize
    hub_rope_parameters: bool = False               # the hub keeps transformers' rope_parameters (Qwen3.5-MoE)
    layers_key: str = "num_hidden_layers"          # the transformers config's decoder-layer count (LongCat-Flash:
                                                    # num_layers; its num_hidden_layers is 2 x num_layers)
    hub_renames: tuple = ()                         # (regex, replacement) pairs applied in order to every hub name
                                                    # (DeepSeek-V4's release names differ from transformers')
    hub_f32: str | None = None                      # regex of hub names stored as F32 (besides the router bias)
    hub_int: str | None = None                      # regex of hub names stored as I32 (DeepSeek-V4's tid2eid)
    random_extra: tuple = ()                        # name suffixes of parameters transformers inits constant, drawn
                                                    # at random so the test sees them (DeepSeek-V4's hc base)
    release_quant: str | None = None                # with fp8=True: ktconvert.testing.<module> writes the release's
                                                    # own quantization (DeepSeek-V4: FP8 blocks + FP4 experts)
    hub_splits: tuple = ()                          # (regex, (replacement, ...)): a tensor the hub stores as equal
                                                    # parts along dim 0 (Kimi Linear's q/k/v short convs)


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
    # hybrid: layer 0 gated DeltaNet, layer 1 gated full attention (full_attention_interval 2; the default is 4);
    # 2 key heads shared by 4 value heads, k/v head dims 32/24, rotary on a quarter of each 32-dim attention head
    "qwen3_next": FixtureFamily(
        config={
            "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 80, "num_experts": 8,
            "num_experts_per_tok": 2, "shared_expert_intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 24,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "norm_topk_prob": True,
            "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 2},
        tokenizer="chatml", hub_extra_keys={"partial_rotary_factor": 0.25}),   # the hub's top-level key
    # Qwen3.5-MoE: Qwen3-Next's hybrid text model under model.language_model., a one-block vision tower under
    # model.visual., text_config nesting, rope_parameters with partial rotary 0.25 and an interleaved M-RoPE section
    # summing to the 4 rotary frequencies. 4 value heads per key head: in_proj_b / in_proj_a have one row per value
    # head, 8 keeps them a whole qzeros pack. Experts 72 wide: with 80 the seed-0 router has a 1e-5 near-tie that the
    # bf16 kernels' activation rounding flips.
    "qwen3_5_moe": FixtureFamily(
        config={
            "text_config": {
                "hidden_size": 128, "moe_intermediate_size": 72, "num_experts": 8, "num_experts_per_tok": 2,
                "shared_expert_intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 8,
                "linear_key_head_dim": 32, "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4,
                "full_attention_interval": 2, "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 2,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [1, 1, 2], "mrope_interleaved": True}},
            "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                              "out_hidden_size": 128, "num_position_embeddings": 16, "patch_size": 4}},
        tokenizer="chatml", model_class="Qwen3_5MoeForConditionalGeneration",
        architecture="Qwen3_5MoeForConditionalGeneration", text_config_key="text_config", hub_rope_parameters=True),
    # GLM-4.5: 5 query heads sharing 1 KV head (head_dim 32: q is wider than hidden, as in the release), partial
    # rotary 0.5, q/k norm and q/k/v bias (GLM-4.5 / 4.6; 4.5-Air has neither norm), 2 groups, MTP layer.
    "glm4_moe": FixtureFamily(
        config={
            "hidden_size": 96, "intermediate_size": 200, "moe_intermediate_size": 80, "n_routed_experts": 8,
            "num_experts_per_tok": 3, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_attention_heads": 5, "num_key_value_heads": 1,
            "head_dim": 32, "partial_rotary_factor": 0.5, "use_qk_norm": True, "attention_bias": True,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "pad_token_id": 0, "eos_token_id": 0},
        tokenizer="glm", partial_rotary_key="partial_rotary_factor", mtp=True),
    # MiniMax-M2: every layer MoE, 7 query heads sharing 1 KV head, q/k norm over the whole projection, rotary_dim 16 of
    # head_dim 32, FP8 release.
    "minimax_m2": FixtureFamily(
        config={
            "hidden_size": 96, "intermediate_size": 80, "num_local_experts": 8, "num_experts_per_tok": 3,
            "num_hidden_layers": 2, "num_attention_heads": 7, "num_key_value_heads": 1, "head_dim": 32,
            "partial_rotary_factor": 0.5, "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 2},
        tokenizer="chatml", moe_block="block_sparse_moe", expert_projs={"gate": "w1", "up": "w3", "down": "w2"},
        partial_rotary_key="rotary_dim", fp8=True,
        fp8_config={"fmt": "float8_e4m3fn", "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
        hub_extra_keys={"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                        "qk_norm_type": "per_layer", "shared_intermediate_size": 0, "attn_type_list": [1, 1]}),
    # DeepSeek-V3.2: V3 plus the lightning indexer; index_topk 8 is shorter than the test prompts, so attention is
    # sparse; 5 heads; FP8 release with the V3.1+ power-of-two block scales.
    "deepseek_v32": FixtureFamily(
        config={
            "hidden_size": 96, "intermediate_size": 200, "moe_intermediate_size": 80, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_attention_heads": 5, "num_key_value_heads": 5,
            "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "index_n_heads": 8, "index_head_dim": 32, "index_topk": 8, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, "num_nextn_predict_layers": 1, "max_position_embeddings": 1024,
            "bos_token_id": 0, "eos_token_id": 1},
        tokenizer="deepseek", fp8=True, fp8_config={"scale_fmt": "ue8m0"},
        hub_extra_keys={"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "ep_size": 1},
        hub_drop_keys=("head_dim", "mlp_layer_types", "layer_types"), mtp=True),
    # GLM-4.7-Flash: MLA (5 heads, v_head_dim 48 != qk_nope_head_dim 32, as the release's 256 != 192) with GLM's MoE
    # (sigmoid routing, correction bias, one group, shared expert), a dense first layer and an MTP layer; the hub's
    # config.json says first_k_dense_replace where transformers writes mlp_layer_types.
    "glm4_moe_lite": FixtureFamily(
        config={
            "hidden_size": 96, "intermediate_size": 200, "moe_intermediate_size": 80, "n_routed_experts": 8,
            "num_experts_per_tok": 3, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
            "num_hidden_layers": 3, "num_attention_heads": 5, "num_key_value_heads": 5, "kv_lora_rank": 32,
            "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 48,
            "routed_scaling_factor": 1.8, "norm_topk_prob": True, "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-5, "pad_token_id": 0, "eos_token_id": 0},
        tokenizer="glm", mtp=True, hub_drop_keys=("mlp_layer_types",),
        hub_extra_keys={"first_k_dense_replace": 1, "num_nextn_predict_layers": 1, "moe_layer_freq": 1,
                        "topk_method": "noaux_tc", "partial_rotary_factor": 1.0}),
    # GLM-5.2: V3.2's MLA + indexer (index_topk 8, shorter than the test prompts; the indexer ropes interleaved
    # pairs) with index sharing: index_topk_freq 3 / index_skip_topk_offset 2 make the layers full, full, shared,
    # shared, full (a shared layer after a shared one, a full one after them); a dense first layer, 2 expert groups,
    # v_head_dim 48 != qk_nope_head_dim 32 (the release's 256 != 192), an MTP layer. The hub's config.json keeps
    # indexer_types and mlp_layer_types beside the freq / offset they follow from (transformers writes all four),
    # as GLM-5.2's does.
    "glm_moe_dsa": FixtureFamily(
        config={
            "hidden_size": 96, "intermediate_size": 200, "moe_intermediate_size": 80, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "num_hidden_layers": 5, "num_attention_heads": 5, "num_key_value_heads": 5,
            "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 48,
            "index_n_heads": 8, "index_head_dim": 32, "index_topk": 8, "index_topk_freq": 3,
            "index_skip_topk_offset": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "pad_token_id": 0, "eos_token_id": 0},
        tokenizer="glm", mtp=True, hub_drop_keys=("layer_types",),
        hub_extra_keys={"num_nextn_predict_layers": 1, "moe_layer_freq": 1, "topk_method": "noaux_tc",
                        "scoring_func": "sigmoid", "rope_interleave": True, "indexer_rope_interleave": True,
                        "index_share_for_mtp_iteration": True}),
    # Kimi-K2.5: Kimi-K2's text model (1 expert group, 3 heads) under language_model., a tiny vision tower beside it,
    # and Kimi's tiktoken tokenizer (tiktoken.model + tokenizer_config.json, no tokenizer.json).
    "kimi_k25": FixtureFamily(
        config={
            "text_config": {
                "hidden_size": 96, "intermediate_size": 200, "moe_intermediate_size": 80, "n_routed_experts": 8,
                "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_attention_heads": 3,
                "num_key_value_heads": 3, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16,
                "qk_nope_head_dim": 32, "v_head_dim": 32, "routed_scaling_factor": 2.827, "norm_topk_prob": True,
                "num_nextn_predict_layers": 0, "max_position_embeddings": 1024},
            "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "pos_emb_height": 4, "pos_emb_width": 4},
            "projection_hidden_size": 32},
        tokenizer="kimi", model_class="Kimi_K25ForConditionalGeneration",
        architecture="KimiK25ForConditionalGeneration", text_config_key="text_config", text_prefix="language_model.",
        hub_extra_keys={"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                        "model_type": "kimi_k2"},
        hub_drop_keys=("head_dim",), vocab_size=672),
    # gpt-oss: sliding (window 6, shorter than the test prompts) / full layers alternating, 4 query heads sharing 2
    # KV heads with sinks, biases everywhere, expert size 96 (not a multiple of 64; a multiple of 32 as MXFP4 needs),
    # YaRN over a 4096-position original context, a low swiglu_limit so the clamps bite at these tiny scales
    "gpt_oss": FixtureFamily(
        config={
            "hidden_size": 96, "intermediate_size": 96, "num_local_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "sliding_window": 6, "swiglu_limit": 0.3, "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
            "bos_token_id": 0, "eos_token_id": 2},
        tokenizer="chatml", fused_experts=True, mxfp4=True, random_biases=True,
        hub_drop_keys=("swiglu_alpha",)),
    # MiMo-V2-Flash: transformers' default layer kinds for 3 layers (full, sliding, sliding; the first a dense MLP),
    # window 8 (sliding_window_size 7, shorter than the test prompts), 4 query heads over 1 kv head in the full
    # layer and 2 in the sliding ones (the release's 4 / 8), q/k heads 48 wide with partial rotary on 16 dims, v heads
    # 32 wide, sinks on the sliding layers, 16 experts 80 wide (not a multiple of 64) picked 4 at a time. config.json
    # in the release's own keys (hybrid_layer_pattern, moe_layer_freq, swa_*, rope_theta / swa_rope_theta,
    # layernorm_epsilon): transformers reads it back with its defaults for what it ignores, which these match.
    "mimo_v2_flash": FixtureFamily(
        config={
            "hidden_size": 96, "intermediate_size": 200, "moe_intermediate_size": 80, "n_routed_experts": 16,
            "num_experts_per_tok": 4, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 48, "v_head_dim": 32, "sliding_window_size": 7, "routed_scaling_factor": 1.5,
            "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 2},
        tokenizer="chatml", hub_drop_keys=("layer_types", "mlp_layer_types"),
        hub_key_renames={"rms_norm_eps": "layernorm_epsilon"},
        hub_extra_keys={"hybrid_layer_pattern": [0, 1, 1], "moe_layer_freq": [0, 1, 1], "sliding_window": 7,
                        "rope_theta": 5000000.0, "swa_rope_theta": 10000.0, "partial_rotary_factor": 0.334,
                        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 48,
                        "swa_v_head_dim": 32, "add_swa_attention_sink_bias": True,
                        "add_full_attention_sink_bias": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                        "n_shared_experts": None, "attention_chunk_size": 7},
        hub_renames=((r"\.self_attn\.sinks$", ".self_attn.attention_sink_bias"),), fp8=True),
    # DeepSeek-V4: one layer of each attention kind (sliding window 6, CSA every 4 tokens with an indexer keeping 2,
    # HCA every 8; 8 indexer heads: weights_proj one whole qzeros pack), the first layer hash-routed, 4 residual
    # streams, grouped output projection (2 groups), partial interleaved rotary on 8 of 32 head dims, YaRN on the
    # compressed layers, a low swiglu_limit so the clamps bite; experts 96 wide (FP4 blocks of 32), the release's own
    # tensor names. config.json says layer_types and compress_rates: the release's legacy per-layer compress_ratios
    # can only say 0 / 4 / 128 (transformers' table), and an HCA rate of 128 would need prompts of hundreds of
    # tokens (tests/test_deepseek_v4.py parses that form).
    "deepseek_v4": FixtureFamily(
        config={
            "hidden_size": 96, "moe_intermediate_size": 96, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32, "partial_rotary_factor": 0.25,
            "q_lora_rank": 48, "o_groups": 2, "o_lora_rank": 24, "sliding_window": 6,
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                            "compressed_sparse_attention"],
            "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "index_n_heads": 8, "index_head_dim": 16,
            "index_topk": 2, "hc_mult": 4, "swiglu_limit": 0.5, "max_position_embeddings": 1024,
            "num_nextn_predict_layers": 1,
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                "beta_fast": 32.0, "beta_slow": 1.0},
            "bos_token_id": 0, "eos_token_id": 1},
        tokenizer="deepseek", moe_block="ffn", expert_projs={"gate": "w1", "up": "w3", "down": "w2"},
        hub_extra_keys={"scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
                        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                         "beta_fast": 32.0, "beta_slow": 1.0}},
        hub_renames=(
            (r"^model\.embed_tokens\.", "embed."), (r"^lm_head\.", "head."), (r"^model\.norm\.", "norm."),
            (r"^model\.hc_head\.hc_", "hc_head_"), (r"^model\.layers\.", "layers."),
            (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
            (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
            (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
            (r"\.self_attn\.", ".attn."), (r"\.kv_proj\.", ".wkv."), (r"\.gate_proj\.", ".wgate."),
            (r"\.position_bias$", ".ape"), (r"(compressor\.)kv_norm\.", r"\1norm."), (r"\.q_a_proj\.", ".wq_a."),
            (r"\.q_a_norm\.", ".q_norm."), (r"\.q_b_proj\.", ".wq_b."), (r"\.o_a_proj\.", ".wo_a."),
            (r"\.o_b_proj\.", ".wo_b."), (r"\.sinks$", ".attn_sink"), (r"\.input_layernorm\.", ".attn_norm."),
            (r"\.post_attention_layernorm\.", ".ffn_norm."), (r"\.(attn|ffn)_hc\.", r".hc_\1_"),
            (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"), (r"\.mlp\.", ".ffn."),
            (r"(shared_experts)\.wgate\.", r"\1.w1."), (r"(shared_experts)\.up_proj\.", r"\1.w3."),
            (r"(shared_experts)\.down_proj\.", r"\1.w2.")),
        hub_f32=r"(hc_head_|.*\.hc_(attn|ffn)_|.*\.attn_sink$|.*\.ape$|.*\.gate\.bias$)",
        hub_int=r".*\.gate\.tid2eid$", random_extra=("base", "position_bias", "sinks"), vocab_size=320,
        fp8=True, release_quant="deepseek_v4"),
    # LongCat-Flash: 2 decoder layers (4 MLA sublayers: 4 KV cache slots), 8 routed + 4 zero (identity) experts
    # picked 3 at a time (the correction bias makes zero experts common, as in the release), experts 80 wide (not a
    # multiple of 64), dense MLPs 200 wide, head_dim = qk_rope_head_dim (transformers ropes head_dim dims). The
    # release's tokenizer has <unk>/<s>/</s>-style ids 0/1/2 (the mistral style's).
    "longcat_flash": FixtureFamily(
        config={
            "hidden_size": 96, "ffn_hidden_size": 200, "expert_ffn_hidden_size": 80, "n_routed_experts": 8,
            "zero_expert_num": 4, "moe_topk": 3, "num_layers": 2, "num_attention_heads": 4,
            "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "head_dim": 16,
            "qk_nope_head_dim": 32, "v_head_dim": 32, "routed_scaling_factor": 6.0,
            "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2},
        tokenizer="mistral", layers_key="num_layers",
        hub_extra_keys={"zero_expert_type": "identity", "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
                        "router_bias": False, "attention_method": "MLA"}),
    # Kimi Linear: KDA, KDA, MLA (no RoPE), KDA (linear_attn_config's 1-indexed kda_layers / full_attn_layers), a dense
    # first layer, 8 KDA heads of 24 (192 channels, not a multiple of 128; b_proj has one row per head, 8 keeps it a
    # whole qzeros pack) with a kernel-4 short conv, 3 MLA heads
    # without q LoRA (as the release), 2 expert groups of 4, one shared expert; the hub's block_sparse_moe / w1-w3
    # names, forget-gate tensors beside the projections and q/k/v convs stored apart. Kimi's tiktoken tokenizer
    # (the release ships tiktoken.model and remote tokenization code, as Kimi-K2.5's).
    "kimi_linear": FixtureFamily(
        config={
            "hidden_size": 96, "intermediate_size": 200, "moe_intermediate_size": 80, "num_experts": 8,
            "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "num_hidden_layers": 4,
            "num_attention_heads": 3, "num_key_value_heads": 3, "kv_lora_rank": 32, "q_lora_rank": None,
            "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "routed_scaling_factor": 2.446,
            "norm_topk_prob": True, "max_position_embeddings": 1024, "first_k_dense_replace": 1,
            "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 8, "head_dim": 24,
                                   "short_conv_kernel_size": 4}},
        tokenizer="kimi", moe_block="block_sparse_moe", expert_projs={"gate": "w1", "up": "w3", "down": "w2"},
        hub_drop_keys=("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads",
                       "linear_conv_kernel_dim", "head_dim"),
        hub_extra_keys={"mla_use_nope": True, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
                        "moe_layer_freq": 1, "num_nextn_predict_layers": 0},
        hub_renames=((r"\.self_attn\.forget_gate\.", ".self_attn."),
                     (r"\.mlp\.(gate\.e_score_correction_bias|shared_experts\.)", r".block_sparse_moe.\1")),
        hub_splits=((r"\.self_attn\.conv1d\.weight$", (".self_attn.q_conv1d.weight", ".self_attn.k_conv1d.weight",
                                                       ".self_attn.v_conv1d.weight")),),
        vocab_size=672),
}
ARCHS = tuple(FIXTURES)
