"""Meituan LongCat-Flash (model_type longcat_flash): each of `num_layers` decoder layers holds TWO MLA attention
sublayers and TWO dense SwiGLU MLPs, plus one MoE whose output joins the residual stream only at the end of the
layer (the "shortcut-connected MoE"):

    h0 = post_attention_layernorm[0](x + self_attn[0](input_layernorm[0](x)))   # x updated by the attention
    moe = MoE(h0); x = x + mlps[0](h0)
    x = x + self_attn[1](input_layernorm[1](x)); x = x + mlps[1](post_attention_layernorm[1](x)) + moe

MLA as DeepSeek-V3's (q LoRA always, RoPE on interleaved pairs, compressed-latent cache: two cache slots per layer,
one per attention sublayer) with LongCat's LoRA scales: q times sqrt(hidden / q_lora_rank), the normalized kv latent
times sqrt(hidden / kv_lora_rank) (`mla_scale_q_lora` / `mla_scale_kv_lora`, true in the release; transformers'
LongcatFlashMLA always applies them, so false is refused).

MoE router (`router.classifier`, float32): softmax over n_routed_experts + zero_expert_num logits, choice by score +
`e_score_correction_bias`, top `moe_topk`, weights = the unbiased scores x routed_scaling_factor (never
normalized). Picks >= n_routed_experts are zero experts (`zero_expert_type` "identity"): they add the MoE input times
their weight and have no tensors. Experts per expert `mlp.experts.E.{gate,up,down}_proj.weight`, every layer MoE, no
shared experts.

The release's multi-token-prediction module sits under `model.mtp.` (not at a layer index): skipped (ktrun decodes
without it). No GGUF architecture: llama.cpp's converter does not write LongCat-Flash.
"""
from __future__ import annotations

from .config import Fields, ModelConfig, parse_rope, token_ids
from .family import Family
from .hub_names import COMMON_ROWS, GATE_UP_DOWN, LAYER, MTP_REASON, HubNames

_SUB = r"\.[01]\."               # the two sublayers' index inside a layer's ModuleLists
ROWS = COMMON_ROWS + [
    (r"model\.mtp\..*", "skip", None, MTP_REASON),
    (LAYER + r"(input_layernorm|post_attention_layernorm)\.[01]\.weight$", "norm", None),
    (LAYER + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$", "expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.router\.classifier\.weight$", "router", None),
    (LAYER + r"mlp\.router\.(e_score_correction_bias|classifier\.bias)$", "router_bias", None),
    (LAYER + r"mlps" + _SUB + r"(?P<proj>gate|up|down)_proj\.weight$", "dense_mlp", GATE_UP_DOWN),
    (LAYER + r"self_attn" + _SUB + r"(q_a_layernorm|kv_a_layernorm)\.weight$", "norm", None),
    (LAYER + r"self_attn" + _SUB + r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.(weight|bias)$",
     "attention", None),
]
EXPERT_NAME = "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"

# transformers LongcatFlashConfig's defaults for the fields we read
DEFAULTS = {"zero_expert_num": 256, "routed_scaling_factor": 6.0, "q_lora_rank": 1536, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "rope_theta": 10000000.0}


def _check_flags(f: Fields) -> None:
    """Fields of the release whose other values transformers' LongcatFlash does not model."""
    kind = f.get("zero_expert_type", "identity")
    f.check(kind == "identity", f"zero_expert_type={kind!r} is not supported (only 'identity' zero experts)")
    for key in ("mla_scale_q_lora", "mla_scale_kv_lora"):
        f.check(f.get(key, True) is True, f"{key}={f.raw.get(key)!r} is not supported: LongCat-Flash's MLA always "
                                          f"scales its LoRA latents (transformers' LongcatFlashMLA)")
    act = f.get("hidden_act", "silu")
    f.check(act == "silu", f"hidden_act={act!r} is not supported (LongCat-Flash's MLPs are SwiGLU: 'silu')")
    method = f.get("attention_method", "MLA")
    f.check(str(method).upper() == "MLA", f"attention_method={method!r} is not supported (LongCat-Flash is 'MLA')")


def parse(f: Fields) -> ModelConfig:
    n_layers, hidden = f.need("num_layers"), f.need("hidden_size")
    total = f.raw.get("num_hidden_layers")
    # transformers derives num_hidden_layers = 2 x num_layers (two attention sublayers each); vLLM's config reads it
    # as num_layers: either is consistent, anything else is not
    f.check(total is None or total in (n_layers, 2 * n_layers),
            f"num_hidden_layers={total!r} is neither num_layers={n_layers} nor 2 x num_layers (the attention "
            f"sublayers)")
    n_experts = f.need("n_routed_experts", "num_local_experts")
    top_k = f.need("moe_topk", "num_experts_per_tok")
    zero = f.get("zero_expert_num", DEFAULTS["zero_expert_num"], cast=int)
    f.check(zero >= 0, f"zero_expert_num={zero} is negative")
    f.check(n_experts >= 1, f"n_routed_experts={n_experts} must be >= 1")
    # the router picks among routed and zero experts alike
    f.check(1 <= top_k <= n_experts + zero, f"moe_topk={top_k} must be in 1..n_routed_experts + zero_expert_num = "
                                            f"{n_experts + zero}")
    _check_flags(f)
    q_lora = f.get("q_lora_rank", DEFAULTS["q_lora_rank"], cast=int)
    f.check(q_lora >= 1, f"q_lora_rank={q_lora} must be >= 1 (LongCat-Flash always projects q through a LoRA)")
    nope, rope_dim, v_dim = f.run("qk_nope_head_dim"), f.run("qk_rope_head_dim"), f.run("v_head_dim")
    if rope_dim is not None:
        # transformers' rotary table is head_dim wide (its default 64 = the release's qk_rope_head_dim)
        head_dim = f.get("head_dim", rope_dim, cast=int)
        f.check(head_dim == rope_dim, f"head_dim={head_dim} differs from qk_rope_head_dim={rope_dim} (the rotary "
                                      f"dims per head; transformers' LongcatFlash ropes head_dim dims)")
        qk = f.get("qk_head_dim", None, cast=int)
        f.check(qk is None or nope is None or qk == nope + rope_dim,
                f"qk_head_dim={qk} is not qk_nope_head_dim + qk_rope_head_dim = {(nope or 0) + rope_dim}")
    nh = f.run("num_attention_heads")
    max_position = f.get("max_position_embeddings", DEFAULTS["max_position_embeddings"], cast=int)
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=f.need("expert_ffn_hidden_size", "moe_intermediate_size"),
        moe_layers=tuple(range(n_layers)), attention="mla", vocab_size=f.run("vocab_size"), num_heads=nh,
        num_kv_heads=f.get("num_key_value_heads", nh, cast=int),       # unused by MLA
        head_dim=rope_dim, intermediate_size=f.run("ffn_hidden_size", "intermediate_size"),
        rope=parse_rope(f, rope_dim, DEFAULTS["rope_theta"], max_position, interleaved=True),
        rms_norm_eps=f.get("rms_norm_eps", DEFAULTS["rms_norm_eps"], cast=float), max_position=max_position,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", False)),
        routed_scaling_factor=f.get("routed_scaling_factor", DEFAULTS["routed_scaling_factor"], cast=float),
        scoring="softmax", topk_method="greedy", q_lora_rank=q_lora, kv_lora_rank=f.run("kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=v_dim, zero_experts=zero,
        bos_token_id=f.raw.get("bos_token_id"), eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw)


FAMILY = Family(
    name="longcat_flash", title="LongCat-Flash", architectures=("LongcatFlashForCausalLM",), parse=parse,
    names=HubNames(ROWS, EXPERT_NAME, GATE_UP_DOWN, moe_prefix="mlp.", router="router.classifier"),
    runtime_module="longcat_flash")
