"""Mixtral: GQA attention (optional sliding window), softmax top-2 routing renormalized over the chosen experts, every
layer MoE. Hub checkpoints name the MoE block `block_sparse_moe` and the expert projections w1/w3/w2 (gate/up/down).
GGUF: llama.cpp's `llama` with experts (its q/k rows permuted for interleaved rope; undone at read)."""
from __future__ import annotations

from .config import Fields, ModelConfig, check_routing, gqa_heads, parse_rope, token_ids
from .errors import ConfigError
from .family import Family
from .gguf_names import ATTN_NORM_ROWS, GLOBAL_ROWS, GGUFArch, Undo, expert_rows, llama_unpermute
from .hub_names import COMMON_ROWS, LAYER, HubNames

W_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}

ROWS = COMMON_ROWS + [
    (LAYER + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3)\.weight$", "expert", W_PROJ),
    (LAYER + r"block_sparse_moe\.gate\.weight$", "router", None),
    (LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$", "attention", None),
]


def parse(f: Fields) -> ModelConfig:
    n_layers, hidden = f.need("num_hidden_layers"), f.need("hidden_size")
    n_experts, top_k = f.need("num_local_experts", "num_experts"), f.need("num_experts_per_tok")
    check_routing(f, n_experts, top_k, experts_key="num_local_experts")
    nh, nkv, hd = gqa_heads(f, hidden, kv_heads_default=8)
    max_position = f.get("max_position_embeddings", 4096 * 32, cast=int)
    inter = f.need("intermediate_size")                      # the experts' size: Mixtral has no dense MLP
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=inter, moe_layers=tuple(range(n_layers)), attention="gqa",
        vocab_size=f.run("vocab_size"), num_heads=nh, num_kv_heads=nkv, head_dim=hd, intermediate_size=inter,
        rope=parse_rope(f, hd, 1_000_000.0, max_position), rms_norm_eps=f.get("rms_norm_eps", 1e-5, cast=float),
        max_position=max_position, tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", False)), sliding_window=f.get("sliding_window", None),
        norm_topk_prob=True, bos_token_id=f.raw.get("bos_token_id"),
        eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw)


def _llama_moe_config(m, cfg: dict, _names: frozenset) -> dict:
    n_experts = m.a("expert_count", 0)
    if not n_experts:
        raise ConfigError(f"{m.where}: GGUF architecture 'llama' without experts is a dense model; ktconvert "
                          f"converts Mixture-of-Experts models (Mixtral-style llama with expert_count > 0)")
    cfg.update({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "head_dim": m.a("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"]),
        "intermediate_size": m.a("feed_forward_length"),
        "num_local_experts": n_experts, "num_experts_per_tok": m.a("expert_used_count"),
    })
    return cfg


GGUF = GGUFArch("llama", GLOBAL_ROWS + ATTN_NORM_ROWS + expert_rows("block_sparse_moe", {
    "gate": "w1", "up": "w3", "down": "w2"}) + [
    (rf"blk\.(?P<L>\d+)\.attn_{g}\.weight", f"model.layers.{{L}}.self_attn.{h}.weight")
    for g, h in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj"))
] + [(r"blk\.(?P<L>\d+)\.ffn_gate_inp\.weight", "model.layers.{L}.block_sparse_moe.gate.weight")],
    _llama_moe_config, undo=[   # llama.cpp permutes q/k rows for its interleaved rope (HF's is half-split)
        (r"self_attn\.q_proj\.weight$", Undo(lambda a, cfg: llama_unpermute(a, cfg["num_attention_heads"]))),
        (r"self_attn\.k_proj\.weight$", Undo(lambda a, cfg: llama_unpermute(a, cfg["num_key_value_heads"])))])

FAMILY = Family(
    name="mixtral", title="Mixtral", architectures=("MixtralForCausalLM",), parse=parse,
    names=HubNames(ROWS, "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
                   {"gate": "w1", "up": "w3", "down": "w2"}, moe_prefix="block_sparse_moe."), gguf=GGUF)
