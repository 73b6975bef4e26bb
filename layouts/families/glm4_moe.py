"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (model_type glm4_moe): GQA attention with partial rotary (RoPE on the first
partial_rotary_factor of each head, halves layout), optional per-head q/k RMSNorm (use_qk_norm: GLM-4.5/4.6 true,
4.5-Air false) and q/k/v bias (attention_bias), sigmoid routing with e_score_correction_bias and group-limited top-k
(n_group / topk_group, 1 group in the releases), routed_scaling_factor, shared experts, first_k_dense_replace dense
layers, and multi-token-prediction layers after the main ones (skipped). GGUF: llama.cpp's `glm4moe`, whose
block_count includes the NextN (MTP) blocks.

Tensor names are DeepSeek's MoE names (mlp.gate, mlp.gate.e_score_correction_bias, mlp.shared_experts,
mlp.experts.E.{gate,up,down}_proj) with Llama-style attention (self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm).
"""
from __future__ import annotations

from .config import Fields, ModelConfig, check_routing, gqa_heads, parse_rope, rotary_dims, token_ids
from .deepseek_v2 import dense_first_moe_layers
from .family import Family
from .gguf_names import ATTN_NORM_ROWS, DENSE_MLP_ROWS, GLOBAL_ROWS, HUB_GATE_UP_DOWN, GGUFArch, expert_rows
from .hub_names import COMMON_ROWS, GATE_UP_DOWN, LAYER, HubNames

ROWS = COMMON_ROWS + [
    (LAYER + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$", "expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.gate\.weight$", "router", None),
    (LAYER + r"mlp\.gate\.e_score_correction_bias$", "router_bias", None),
    (LAYER + r"mlp\.shared_experts\.(?P<proj>gate|up|down)_proj\.weight$", "shared_expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.(?P<proj>gate|up|down)_proj\.weight$", "dense_mlp", GATE_UP_DOWN),
    (LAYER + r"self_attn\.(q_norm|k_norm)\.weight$", "norm", None),
    (LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$", "attention", None),
]

# transformers Glm4MoeConfig's defaults for the fields we read (its rope_theta is PreTrainedConfig's 10000)
DEFAULTS = {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 1.0, "n_shared_experts": 1, "num_key_value_heads": 8,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5,
            "num_nextn_predict_layers": 1, "rope_theta": 10000.0}


def parse(f: Fields) -> ModelConfig:
    n_layers, hidden = f.need("num_hidden_layers"), f.need("hidden_size")
    n_experts, top_k = f.need("n_routed_experts", "num_local_experts"), f.need("num_experts_per_tok")
    n_group = f.get("n_group", DEFAULTS["n_group"], cast=int)
    topk_group = f.get("topk_group", DEFAULTS["topk_group"], cast=int)
    check_routing(f, n_experts, top_k, n_group, topk_group, grouped=True, sigmoid_groups=True)
    first_dense = f.get("first_k_dense_replace", DEFAULTS["first_k_dense_replace"], cast=int)
    f.check(first_dense >= 0, f"first_k_dense_replace={first_dense} is negative")
    nh, nkv, hd = gqa_heads(f, hidden, kv_heads_default=DEFAULTS["num_key_value_heads"])
    max_position = f.get("max_position_embeddings", DEFAULTS["max_position_embeddings"], cast=int)
    rot = rotary_dims(f, hd, DEFAULTS["partial_rotary_factor"])
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=f.need("moe_intermediate_size"),
        moe_layers=dense_first_moe_layers(n_layers, n_experts, first_dense, 1), attention="gqa",
        vocab_size=f.run("vocab_size"), num_heads=nh, num_kv_heads=nkv, head_dim=hd,
        intermediate_size=f.run("intermediate_size"),
        rope=parse_rope(f, rot, DEFAULTS["rope_theta"], max_position),
        rms_norm_eps=f.get("rms_norm_eps", DEFAULTS["rms_norm_eps"], cast=float), max_position=max_position,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", False)), qk_norm=bool(f.get("use_qk_norm", False)),
        n_shared_experts=f.get("n_shared_experts", DEFAULTS["n_shared_experts"], cast=int), first_k_dense=first_dense,
        n_mtp_layers=f.get("num_nextn_predict_layers", DEFAULTS["num_nextn_predict_layers"], cast=int),
        norm_topk_prob=bool(f.get("norm_topk_prob", DEFAULTS["norm_topk_prob"])),
        routed_scaling_factor=f.get("routed_scaling_factor", DEFAULTS["routed_scaling_factor"], cast=float),
        scoring="sigmoid", topk_method="noaux_tc", n_group=n_group, topk_group=topk_group,
        bos_token_id=f.raw.get("bos_token_id"), eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw)


def _glm4moe_config(m, cfg: dict, names: frozenset) -> dict:
    n_mtp = m.a("nextn_predict_layers", 0)
    head_dim = m.a("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.update({
        "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
        "num_hidden_layers": cfg["num_hidden_layers"] - n_mtp,       # llama.cpp counts the NextN blocks too
        "num_nextn_predict_layers": n_mtp, "head_dim": head_dim,
        "partial_rotary_factor": m.a("rope.dimension_count", head_dim // 2) / head_dim,
        "intermediate_size": m.a("feed_forward_length"),
        "moe_intermediate_size": m.a("expert_feed_forward_length"),
        "n_routed_experts": m.a("expert_count"), "num_experts_per_tok": m.a("expert_used_count"),
        "n_shared_experts": m.a("expert_shared_count", 0),
        "first_k_dense_replace": m.a("leading_dense_block_count", 0),
        "routed_scaling_factor": m.a("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(m.a("expert_weights_norm", False)),
        "n_group": m.a("expert_group_count", 1) or 1, "topk_group": m.a("expert_group_used_count", 1) or 1,
        "use_qk_norm": any(n.endswith("attn_q_norm.weight") for n in names),
        "attention_bias": any(n.endswith("attn_q.bias") for n in names),
    })
    return cfg


# --- GGUF: llama.cpp's "glm4moe" ---------------------------------------------------------------------------------
# Its post-attention norm is `post_attention_norm` (not ffn_norm); blk.N for N >= num_hidden_layers are the NextN
# (MTP) blocks, with their own nextn.* tensors; the reader skips those blocks.
_NEXTN = "(eh_proj|embed_tokens|enorm|hnorm|shared_head_head|shared_head_norm)"
GGUF = GGUFArch("glm4moe", GLOBAL_ROWS + ATTN_NORM_ROWS[:1] + DENSE_MLP_ROWS + expert_rows("mlp", HUB_GATE_UP_DOWN) + [
    (r"blk\.(?P<L>\d+)\.post_attention_norm\.weight", "model.layers.{L}.post_attention_layernorm.weight"),
    (r"blk\.(?P<L>\d+)\.attn_output\.weight", "model.layers.{L}.self_attn.o_proj.weight"),
    (r"blk\.(?P<L>\d+)\.attn_q_norm\.weight", "model.layers.{L}.self_attn.q_norm.weight"),
    (r"blk\.(?P<L>\d+)\.attn_k_norm\.weight", "model.layers.{L}.self_attn.k_norm.weight"),
    (r"blk\.(?P<L>\d+)\.ffn_gate_inp\.weight", "model.layers.{L}.mlp.gate.weight"),
    (r"blk\.(?P<L>\d+)\.exp_probs_b\.bias", "model.layers.{L}.mlp.gate.e_score_correction_bias"),
    (rf"blk\.(?P<L>\d+)\.nextn\.{_NEXTN}\.weight", "model.layers.{L}.nextn.weight"),   # MTP block: skipped
] + [(rf"blk\.(?P<L>\d+)\.ffn_{p}_shexp\.weight", f"model.layers.{{L}}.mlp.shared_experts.{p}_proj.weight")
     for p in ("gate", "up", "down")] + [
    (rf"blk\.(?P<L>\d+)\.attn_{p}\.{t}", f"model.layers.{{L}}.self_attn.{p}_proj.{t}")
    for p in ("q", "k", "v") for t in ("weight", "bias")], _glm4moe_config)

FAMILY = Family(
    name="glm4_moe", title="GLM-4.5 / 4.6 / 4.7", architectures=("Glm4MoeForCausalLM",), parse=parse,
    names=HubNames(ROWS, "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight", GATE_UP_DOWN,
                   moe_prefix="mlp.", shared_prefix="mlp.shared_experts.", mtp=True), gguf=GGUF)
