"""Qwen3-Next: a hybrid stack. Most layers run gated DeltaNet linear attention (`linear_attn`: a causal depthwise
conv over q|k|v, then the gated delta rule over a per-request recurrent state); every `full_attention_interval`-th
layer runs gated full attention (`self_attn`: q_proj also yields a sigmoid output gate; per-head q/k RMSNorm; RoPE on
the first partial_rotary_factor of each head). The MoE block is Qwen3-MoE's softmax top-k (renormalized) plus one
shared expert scaled by sigmoid(shared_expert_gate). Every RMSNorm outside the DeltaNet's gated norm is
zero-centred (scales by 1 + weight). Hub checkpoints carry a multi-token-prediction head under `mtp.` (skipped).
No GGUF architecture: llama.cpp's qwen3next is not read here yet.
"""
from __future__ import annotations

from .config import Fields, LinearAttentionConfig, ModelConfig, check_routing, parse_rope, token_ids
from .family import Family
from .hub_names import COMMON_ROWS, GATE_UP_DOWN, LAYER, HubNames

LAYER_TYPES = ("linear_attention", "full_attention")

ROWS = COMMON_ROWS + [
    (r"mtp\..*", "skip", None),                                   # multi-token-prediction head: not the main model
    (LAYER + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$", "expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.gate\.weight$", "router", None),
    # the shared expert's gate is one row (1, H): a router-like gate, kept in full precision like the router
    (LAYER + r"mlp\.shared_expert_gate\.weight$", "shared_expert_gate", None),   # (1, H): kept as the router is
    (LAYER + r"mlp\.shared_expert\.(?P<proj>gate|up|down)_proj\.weight$", "shared_expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.(?P<proj>gate|up|down)_proj\.weight$", "dense_mlp", GATE_UP_DOWN),  # mlp_only_layers
    (LAYER + r"self_attn\.(q_norm|k_norm)\.weight$", "norm", None),
    (LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$", "attention", None),
    (LAYER + r"linear_attn\.norm\.weight$", "norm", None),
    # in_proj_qkvz / in_proj_ba / out_proj are Linears; conv1d (conv_dim, 1, kernel), A_log and dt_bias (v_heads,)
    # are not (the GPU-layer encoders quantize 2-D .weight tensors only)
    (LAYER + r"linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj|conv1d)\.weight$", "attention", None),
    (LAYER + r"linear_attn\.(A_log|dt_bias)$", "attention", None),
]

# transformers Qwen3NextConfig's defaults for the fields read here (tests/test_families.py checks them)
DEFAULTS = {"num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "intermediate_size": 5632,
            "norm_topk_prob": True}


def _layer_types(f: Fields, n_layers: int) -> tuple[str, ...]:
    def every_interval() -> tuple[str, ...]:
        interval = f.get("full_attention_interval", DEFAULTS["full_attention_interval"], cast=int)
        f.check(interval >= 1, f"full_attention_interval={interval} must be >= 1")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))
    return f.layer_types(n_layers, LAYER_TYPES, every_interval)


def _linear_attention(f: Fields) -> LinearAttentionConfig:
    d = {k: f.get(k, DEFAULTS[k], cast=int) for k in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                     "linear_value_head_dim", "linear_num_key_heads",
                                                     "linear_num_value_heads")}
    for k, v in d.items():
        f.check(v >= 1, f"field {k!r} = {v} must be >= 1")
    nk, nv = d["linear_num_key_heads"], d["linear_num_value_heads"]
    f.check(nv % nk == 0, f"linear_num_value_heads={nv} is not a multiple of linear_num_key_heads={nk}")
    return LinearAttentionConfig(conv_kernel=d["linear_conv_kernel_dim"], num_k_heads=nk, num_v_heads=nv,
                                 k_head_dim=d["linear_key_head_dim"], v_head_dim=d["linear_value_head_dim"])


def _rotary_dim(f: Fields, head_dim: int | None) -> int | None:
    if head_dim is None:
        return None
    params = f.raw.get("rope_parameters") or f.raw.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", f.raw.get("partial_rotary_factor"))
    factor = DEFAULTS["partial_rotary_factor"] if factor is None else factor
    f.check(isinstance(factor, (int, float)) and 0 < factor <= 1,
            f"field 'partial_rotary_factor' = {factor!r} must be in (0, 1]")
    dim = int(head_dim * factor)
    f.check(dim >= 2 and dim % 2 == 0, f"partial_rotary_factor={factor} x head_dim={head_dim} gives an odd or "
                                       f"empty rotary dimension {dim}")
    return dim


def parse(f: Fields) -> ModelConfig:
    n_layers, hidden = f.need("num_hidden_layers"), f.need("hidden_size")
    n_experts, top_k = f.need("num_experts"), f.need("num_experts_per_tok")
    check_routing(f, n_experts, top_k, experts_key="num_experts")
    step = f.get("decoder_sparse_step", 1, cast=int)
    f.check(step >= 1, f"decoder_sparse_step={step} must be >= 1")
    dense = set(f.get("mlp_only_layers", []))
    nh = f.run("num_attention_heads")
    nkv = hd = None
    if nh is not None:
        nkv = f.get("num_key_value_heads", DEFAULTS["num_key_value_heads"], cast=int)
        f.check(nh % nkv == 0, f"num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}")
        hd = f.get("head_dim", DEFAULTS["head_dim"], cast=int)
    max_position = f.get("max_position_embeddings", DEFAULTS["max_position_embeddings"], cast=int)
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=f.need("moe_intermediate_size"),
        moe_layers=tuple(i for i in range(n_layers) if i not in dense and n_experts > 0 and (i + 1) % step == 0),
        attention="gqa", vocab_size=f.run("vocab_size"), num_heads=nh, num_kv_heads=nkv, head_dim=hd,
        intermediate_size=f.get("intermediate_size", DEFAULTS["intermediate_size"], cast=int),
        rope=parse_rope(f, _rotary_dim(f, hd), DEFAULTS["rope_theta"], max_position),
        rms_norm_eps=f.get("rms_norm_eps", DEFAULTS["rms_norm_eps"], cast=float), max_position=max_position,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", False)), qk_norm=True,
        n_shared_experts=1 if f.get("shared_expert_intermediate_size", 512, cast=int) > 0 else 0,
        norm_topk_prob=bool(f.get("norm_topk_prob", DEFAULTS["norm_topk_prob"])),
        layer_types=_layer_types(f, n_layers), linear_attention=_linear_attention(f),
        bos_token_id=f.raw.get("bos_token_id"), eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw)


FAMILY = Family(
    name="qwen3_next", title="Qwen3-Next", architectures=("Qwen3NextForCausalLM",), parse=parse,
    names=HubNames(ROWS, "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight", GATE_UP_DOWN,
                   moe_prefix="mlp.", shared_prefix="mlp.shared_expert."),
    runtime_module="qwen3_next")
