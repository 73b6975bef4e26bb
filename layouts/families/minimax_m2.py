"""MiniMax-M2 / M2.1 (model_type minimax_m2): GQA attention with q/k RMSNorm over the whole projection (all heads at
once, qk_norm_type "per_layer"), partial rotary (`rotary_dim` of each head_dim, halves layout), sigmoid routing with
e_score_correction_bias (use_routing_bias) and plain top-k, weights renormalized over the chosen experts, no shared
experts, every layer MoE. The expert size is `intermediate_size` (there is no dense MLP). The release ships FP8
e4m3 weights with 128x128 block scales (`weight_scale_inv`, quantization_config fmt "float8_e4m3fn"), read by the
DeepSeek FP8 reader. Hub checkpoints name the MoE block `block_sparse_moe` (router `gate`, the bias beside it, experts
w1/w3/w2). GGUF: llama.cpp's `minimax-m2`.
"""
from __future__ import annotations

from .config import Fields, ModelConfig, check_routing, parse_rope, rotary_dims, token_ids
from .family import Family
from .gguf_names import ATTN_NORM_ROWS, GLOBAL_ROWS, GGUFArch, expert_rows
from .hub_names import COMMON_ROWS, LAYER, HubNames

W_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}

ROWS = COMMON_ROWS + [
    (LAYER + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3)\.weight$", "expert", W_PROJ),
    (LAYER + r"block_sparse_moe\.gate\.weight$", "router", None),
    (LAYER + r"block_sparse_moe\.e_score_correction_bias$", "router_bias", None),
    (LAYER + r"self_attn\.(q_norm|k_norm)\.weight$", "norm", None),
    (LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$", "attention", None),
]

# transformers MiniMaxM2Config's defaults for the fields we read
DEFAULTS = {"num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 196608, "rms_norm_eps": 1e-6,
            "rope_theta": 5_000_000.0}
QK_NORM_SCOPES = {"per_layer": "projection", "per_head": "head"}


def parse(f: Fields) -> ModelConfig:
    n_layers, hidden = f.need("num_hidden_layers"), f.need("hidden_size")
    n_experts, top_k = f.need("num_local_experts", "num_experts"), f.need("num_experts_per_tok")
    check_routing(f, n_experts, top_k, experts_key="num_local_experts")
    f.check(n_experts != 1, "num_local_experts=1: sigmoid routing needs at least 2 experts")
    scoring = f.get("scoring_func", "sigmoid")
    f.check(scoring == "sigmoid", f"scoring_func {scoring!r} is not 'sigmoid' (the only routing MiniMax-M2 has)")
    shared = f.get("shared_intermediate_size", 0, cast=int)
    f.check(shared == 0, f"shared_intermediate_size={shared}: MiniMax-M2 releases have no shared experts and "
                         f"transformers' MiniMaxM2 does not model them")
    attn_types = f.get("attn_type_list", None)
    if attn_types is not None:
        f.check(isinstance(attn_types, list) and len(attn_types) == n_layers,
                f"attn_type_list has {len(attn_types) if isinstance(attn_types, list) else attn_types!r} entries, "
                f"num_hidden_layers={n_layers}")
        f.check(all(t == 1 for t in attn_types), "attn_type_list holds 0 (lightning / linear attention, "
                                                 "MiniMax-Text-01): only full attention (1) is supported")
    scope = f.get("qk_norm_type", "per_layer")
    f.check(scope in QK_NORM_SCOPES, f"qk_norm_type {scope!r} is not one of {', '.join(QK_NORM_SCOPES)}")
    nh = f.run("num_attention_heads")
    nkv = f.get("num_key_value_heads", DEFAULTS["num_key_value_heads"], cast=int) if nh is not None else None
    hd = f.get("head_dim", DEFAULTS["head_dim"], cast=int) if nh is not None else None
    if nh is not None:
        f.check(nh % nkv == 0, f"num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}")
    max_position = f.get("max_position_embeddings", DEFAULTS["max_position_embeddings"], cast=int)
    inter = f.need("intermediate_size")                        # the experts' size: no dense MLP
    mtp = f.get("num_mtp_modules", 0, cast=int) if f.get("use_mtp", False) else 0
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=inter, moe_layers=tuple(range(n_layers)) if n_experts else (), attention="gqa",
        vocab_size=f.run("vocab_size"), num_heads=nh, num_kv_heads=nkv, head_dim=hd, intermediate_size=inter,
        rope=parse_rope(f, rotary_dims(f, hd, 1.0), DEFAULTS["rope_theta"], max_position),
        rms_norm_eps=f.get("rms_norm_eps", DEFAULTS["rms_norm_eps"], cast=float), max_position=max_position,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        qk_norm=bool(f.get("use_qk_norm", True)), qk_norm_scope=QK_NORM_SCOPES[scope], n_mtp_layers=mtp,
        norm_topk_prob=True, scoring="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
        bos_token_id=f.raw.get("bos_token_id"), eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw)


def _minimax_m2_config(m, cfg: dict, _names: frozenset) -> dict:
    head_dim = m.a("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.update({
        "model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "head_dim": head_dim,
        "rotary_dim": m.a("rope.dimension_count", head_dim),
        "intermediate_size": m.a("expert_feed_forward_length"),
        "num_local_experts": m.a("expert_count"), "num_experts_per_tok": m.a("expert_used_count"),
        "scoring_func": "sigmoid", "use_routing_bias": True,
    })
    return cfg


GGUF = GGUFArch("minimax-m2", GLOBAL_ROWS + ATTN_NORM_ROWS + expert_rows("block_sparse_moe", {
    "gate": "w1", "up": "w3", "down": "w2"}) + [
    (rf"blk\.(?P<L>\d+)\.attn_{g}\.weight", f"model.layers.{{L}}.self_attn.{h}.weight")
    for g, h in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj"),
                 ("q_norm", "q_norm"), ("k_norm", "k_norm"))
] + [(r"blk\.(?P<L>\d+)\.ffn_gate_inp\.weight", "model.layers.{L}.block_sparse_moe.gate.weight"),
     (r"blk\.(?P<L>\d+)\.exp_probs_b\.bias", "model.layers.{L}.block_sparse_moe.e_score_correction_bias")],
    _minimax_m2_config)

FAMILY = Family(
    name="minimax_m2", title="MiniMax-M2 / M2.1", architectures=("MiniMaxM2ForCausalLM",), parse=parse,
    names=HubNames(ROWS, "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
                   {"gate": "w1", "up": "w3", "down": "w2"}, moe_prefix="block_sparse_moe.", mtp=True), gguf=GGUF)
