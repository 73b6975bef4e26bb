"""gpt-oss (OpenAI): GQA attention with biases on q/k/v/o and a learned sink logit per head (it joins each query's
softmax and is dropped after it); layers alternate sliding-window (`sliding_window` keys) and full attention
(`layer_types`); RoPE over whole heads with YaRN. Every layer is MoE: the router is a Linear with bias
(`mlp.router`), top-k of its logits then a softmax over those k. Routed experts carry biases and a clamped SwiGLU
(ExpertActivation "swiglu_clamped", alpha = 1.702, limit = swiglu_limit); no shared experts, no dense MLP.
The hub stores each layer's experts fused (FusedExperts): MXFP4 blocks + E8M0 scales in the openai/ releases
(quantization_config quant_method "mxfp4"), bf16 (E, H, 2I) / (E, I, H) in the unquantized ones.
GGUF: llama.cpp's `gpt-oss`: experts stacked per projection (MXFP4 blocks in the converted releases), their biases as
gate / up / down stacks (joined back into the hub's interleaved gate_up bias), sinks as attn_sinks.
"""
from __future__ import annotations

import numpy as np

from .config import ExpertActivation, Fields, ModelConfig, check_routing, gqa_heads, parse_rope, token_ids
from .family import Family
from .gguf_names import ATTN_NORM_ROWS, GLOBAL_ROWS, HUB_GATE_UP_DOWN, GGUFArch, Join, expert_rows
from .hub_names import COMMON_ROWS, GATE_UP_DOWN, LAYER, FusedExperts, HubNames

LAYER_TYPES = ("sliding_attention", "full_attention")

ROWS = COMMON_ROWS + [
    # the converter's per-expert names for the fused tensors (ktconvert.sources.fused_experts makes them)
    (LAYER + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$", "expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.experts\.(gate_up_proj|down_proj)_bias$", "expert_bias", None),
    # the hub's fused tensors themselves: all of a layer's experts (expert None)
    (LAYER + r"mlp\.experts\.(gate_up_proj|down_proj)(_blocks|_scales)?$", "expert", None),
    (LAYER + r"mlp\.router\.weight$", "router", None),
    (LAYER + r"mlp\.router\.bias$", "router_bias", None),
    (LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$", "attention", None),
    (LAYER + r"self_attn\.sinks$", "attention", None),      # (num_heads,): not a Linear, kept as stored
]

# transformers GptOssConfig's defaults for the fields read here (tests/test_families.py checks them)
DEFAULTS = {"num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 150000.0, "sliding_window": 128, "swiglu_limit": 7.0, "attention_bias": True}
# GptOssConfig's rope when config.json names none: YaRN x32 over a 4096-position original context, untruncated
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
SWIGLU_ALPHA = 1.702      # fixed in the reference (GptOssExperts.alpha); newer configs may carry swiglu_alpha


def _layer_types(f: Fields, n_layers: int) -> tuple[str, ...]:
    # transformers' default: sliding first, then alternating
    return f.layer_types(n_layers, LAYER_TYPES, lambda: tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                                              for i in range(n_layers)))


def parse(f: Fields) -> ModelConfig:
    n_layers, hidden = f.need("num_hidden_layers"), f.need("hidden_size")
    n_experts, top_k = f.need("num_local_experts", "num_experts"), f.need("num_experts_per_tok", "experts_per_token")
    check_routing(f, n_experts, top_k, experts_key="num_local_experts")
    nh, nkv, hd = gqa_heads(f, hidden, kv_heads_default=DEFAULTS["num_key_value_heads"])
    if nh is not None and f.raw.get("head_dim") is None:
        hd = DEFAULTS["head_dim"]
    window = f.get("sliding_window", DEFAULTS["sliding_window"], cast=int)
    f.check(window >= 1, f"sliding_window={window} must be >= 1")
    limit = f.get("swiglu_limit", DEFAULTS["swiglu_limit"], cast=float)
    f.check(limit > 0, f"swiglu_limit={limit} must be > 0")
    alpha = f.get("swiglu_alpha", SWIGLU_ALPHA, cast=float)
    max_position = f.get("max_position_embeddings", DEFAULTS["max_position_embeddings"], cast=int)
    inter = f.need("intermediate_size")             # the experts' size: gpt-oss has no dense MLP
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=inter, moe_layers=tuple(range(n_layers)) if n_experts else (), attention="gqa",
        vocab_size=f.run("vocab_size"), num_heads=nh, num_kv_heads=nkv, head_dim=hd, intermediate_size=inter,
        rope=parse_rope(f if f.raw.get("rope_parameters") or f.raw.get("rope_scaling") else
                        Fields({**f.raw, "rope_scaling": DEFAULT_ROPE}, f.where, f.model_type, f.for_runtime),
                        hd, DEFAULTS["rope_theta"], max_position),
        rms_norm_eps=f.get("rms_norm_eps", DEFAULTS["rms_norm_eps"], cast=float), max_position=max_position,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", DEFAULTS["attention_bias"])), sliding_window=window,
        layer_types=_layer_types(f, n_layers), attention_sinks=True,
        expert_activation=ExpertActivation("swiglu_clamped", alpha=alpha, limit=limit, bias=True),
        bos_token_id=f.raw.get("bos_token_id"), eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw)


# --- GGUF: llama.cpp's "gpt-oss" -------------------------------------------------------------------------------
# convert_hf_to_gguf's GptOssModel splits the fused experts into gate / up / down stacks (MXFP4 blocks repacked to
# ggml's MXFP4, or floats), the gate_up bias into gate (even) and up (odd) bias stacks, and writes sinks as
# attn_sinks.weight. GGUF carries no swiglu_limit / swiglu_alpha: llama.cpp computes the clamped SwiGLU with the
# release's 7.0 and 1.702 (ggml_swiglu_oai), and so does the config written here. Sliding-window layers: the
# sliding_window_pattern key when present, else llama.cpp's default for gpt-oss (every other layer from layer 0).
def _gate_up_bias_shape(parts: dict, cfg: dict) -> tuple:
    e, i = parts["gate"]
    return (e, 2 * i)


def _gate_up_bias(parts: dict, cfg: dict):
    """gate (E, I) and up (E, I) bias stacks -> the hub's gate_up bias (E, 2I), gate and up interleaved."""
    return np.stack([parts["gate"], parts["up"]], axis=-1).reshape(_gate_up_bias_shape(
        {"gate": parts["gate"].shape}, cfg))


GATE_UP_BIAS = Join(("gate", "up"), _gate_up_bias_shape, _gate_up_bias)


def _gpt_oss_config(m, cfg: dict, names: frozenset) -> dict:
    n_layers = cfg["num_hidden_layers"]
    pattern = m.a("attention.sliding_window_pattern", 2)
    sliding = ([bool(x) for x in pattern][:n_layers] if isinstance(pattern, list) else
               [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)])    # llama.cpp's rule
    cfg.update({
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "head_dim": m.a("attention.key_length"),
        "num_local_experts": m.a("expert_count"), "num_experts_per_tok": m.a("expert_used_count"),
        "intermediate_size": m.a("expert_feed_forward_length"), "sliding_window": m.a("attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "swiglu_limit": DEFAULTS["swiglu_limit"], "attention_bias": any(n.endswith("attn_q.bias") for n in names),
    })
    if m.a("rope.scaling.type", "none") == "yarn":
        cfg["rope_scaling"] = {
            "rope_type": "yarn", "factor": m.a("rope.scaling.factor"),
            "original_max_position_embeddings": m.a("rope.scaling.original_context_length"),
            "beta_fast": m.a("rope.scaling.yarn_beta_fast", DEFAULT_ROPE["beta_fast"]),
            "beta_slow": m.a("rope.scaling.yarn_beta_slow", DEFAULT_ROPE["beta_slow"]), "truncate": False}
    return cfg


_L = r"blk\.(?P<L>\d+)\."
GGUF = GGUFArch("gpt-oss", GLOBAL_ROWS + ATTN_NORM_ROWS[:1] + expert_rows("mlp", HUB_GATE_UP_DOWN) + [
    (_L + r"post_attention_norm\.weight", "model.layers.{L}.post_attention_layernorm.weight"),
    (_L + r"attn_sinks\.weight", "model.layers.{L}.self_attn.sinks"),
    (_L + r"ffn_gate_inp\.weight", "model.layers.{L}.mlp.router.weight"),
    (_L + r"ffn_gate_inp\.bias", "model.layers.{L}.mlp.router.bias"),
    (_L + r"ffn_gate_exps\.bias", "model.layers.{L}.mlp.experts.gate_up_proj_bias", GATE_UP_BIAS, "gate"),
    (_L + r"ffn_up_exps\.bias", "model.layers.{L}.mlp.experts.gate_up_proj_bias", GATE_UP_BIAS, "up"),
    (_L + r"ffn_down_exps\.bias", "model.layers.{L}.mlp.experts.down_proj_bias"),
] + [(_L + rf"attn_{g}\.{t}", f"model.layers.{{L}}.self_attn.{h}.{t}")
     for g, h in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")) for t in ("weight", "bias")],
    _gpt_oss_config)

FAMILY = Family(
    name="gpt_oss", title="gpt-oss", architectures=("GptOssForCausalLM",), parse=parse,
    names=HubNames(ROWS, "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight", GATE_UP_DOWN,
                   moe_prefix="mlp.", router="router", fused_experts=FusedExperts()),
    runtime_module="gpt_oss", gguf=GGUF)
