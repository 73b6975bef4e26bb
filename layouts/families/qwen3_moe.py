"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k routing (renormalized when norm_topk_prob), no shared
experts; mlp_only_layers / decoder_sparse_step choose the dense layers. GGUF: llama.cpp's `qwen3moe`."""
from __future__ import annotations

from .config import Fields, ModelConfig, check_routing, gqa_heads, parse_rope, token_ids
from .family import Family
from .gguf_names import ATTN_NORM_ROWS, GLOBAL_ROWS, HUB_GATE_UP_DOWN, GGUFArch, expert_rows
from .hub_names import COMMON_ROWS, GATE_UP_DOWN, LAYER, HubNames

ROWS = COMMON_ROWS + [
    (LAYER + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$", "expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.gate\.weight$", "router", None),
    (LAYER + r"mlp\.(?P<proj>gate|up|down)_proj\.weight$", "dense_mlp", GATE_UP_DOWN),  # mlp_only_layers
    (LAYER + r"self_attn\.(q_norm|k_norm)\.weight$", "norm", None),
    (LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$", "attention", None),
]


def parse(f: Fields) -> ModelConfig:
    n_layers, hidden = f.need("num_hidden_layers"), f.need("hidden_size")
    n_experts, top_k = f.need("num_experts", "num_local_experts"), f.need("num_experts_per_tok")
    check_routing(f, n_experts, top_k, experts_key="num_experts")
    step = f.get("decoder_sparse_step", 1, cast=int)
    f.check(step >= 1, f"decoder_sparse_step={step} must be >= 1")
    dense = set(f.get("mlp_only_layers", []))
    nh, nkv, hd = gqa_heads(f, hidden, kv_heads_default=4)
    max_position = f.get("max_position_embeddings", 32768, cast=int)
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=f.need("moe_intermediate_size"),
        moe_layers=tuple(i for i in range(n_layers) if i not in dense and n_experts > 0 and (i + 1) % step == 0),
        attention="gqa", vocab_size=f.run("vocab_size"), num_heads=nh, num_kv_heads=nkv, head_dim=hd,
        intermediate_size=f.run("intermediate_size"), rope=parse_rope(f, hd, 10000.0, max_position),
        rms_norm_eps=f.get("rms_norm_eps", 1e-6, cast=float), max_position=max_position,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", False)), qk_norm=True,
        sliding_window=f.get("sliding_window", 4096) if f.get("use_sliding_window", False) else None,
        norm_topk_prob=bool(f.get("norm_topk_prob", False)), bos_token_id=f.raw.get("bos_token_id"),
        eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw)


def _qwen3moe_config(m, cfg: dict, _names: frozenset) -> dict:
    cfg.update({
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": m.a("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"]),
        "intermediate_size": m.a("feed_forward_length", m.a("expert_feed_forward_length")),
        "moe_intermediate_size": m.a("expert_feed_forward_length"),
        "num_experts": m.a("expert_count"), "num_experts_per_tok": m.a("expert_used_count"),
        "norm_topk_prob": bool(m.a("expert_weights_norm", True)),
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    })
    return cfg


# llama.cpp's qwen3moe has no dense-MLP tensors (its converter refuses mlp_only_layers), so no ffn_{gate,up,down} rows
GGUF = GGUFArch("qwen3moe", GLOBAL_ROWS + ATTN_NORM_ROWS + expert_rows("mlp", HUB_GATE_UP_DOWN) + [
    (rf"blk\.(?P<L>\d+)\.attn_{g}\.weight", f"model.layers.{{L}}.self_attn.{h}.weight")
    for g, h in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj"),
                 ("q_norm", "q_norm"), ("k_norm", "k_norm"))
] + [(r"blk\.(?P<L>\d+)\.ffn_gate_inp\.weight", "model.layers.{L}.mlp.gate.weight")], _qwen3moe_config)

FAMILY = Family(
    name="qwen3_moe", title="Qwen3-MoE", architectures=("Qwen3MoeForCausalLM",), parse=parse,
    names=HubNames(ROWS, "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight", GATE_UP_DOWN), gguf=GGUF)
