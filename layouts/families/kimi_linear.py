"""Kimi Linear (Moonshot, Kimi-Linear-48B-A3B): a hybrid stack. Most layers run Kimi Delta Attention (KDA: separate
q/k/v projections, a causal depthwise short conv over each (q_conv1d / k_conv1d / v_conv1d, SiLU), then a gated delta
rule whose decay is per key channel: a low-rank forget gate f_b(f_a(x)) + dt_bias through -exp(A_log) * softplus,
beta = sigmoid(b_proj x); the output is RMS-normed per head and gated by sigmoid(g_b(g_a(x))) before o_proj); the
others (config.json's linear_attn_config.full_attn_layers, 1-indexed) run DeepSeek's MLA without RoPE
(`mla_use_nope`: the qk_rope_head_dim part of the keys is shared across heads but never rotated; scale
(qk_nope + qk_rope)^-1/2, no YaRN). The MoE block (`block_sparse_moe`, experts w1/w3/w2) routes by sigmoid with
e_score_correction_bias in groups (num_expert_group / topk_group), renormalizes (moe_renormalize) and scales by
routed_scaling_factor, plus num_shared_experts shared experts; the first first_k_dense_replace layers are a dense MLP
(`mlp.`). transformers 5 spells the hub's fields differently (num_experts_per_tok, n_group, norm_topk_prob,
max_position_embeddings, layer_types / mlp_layer_types, linear_num_heads / linear_head_dim /
linear_conv_kernel_dim): both spellings are read. GGUF: not converted here (llama.cpp's `kimi-linear` is not read).
"""
from __future__ import annotations

from . import deepseek_v2
from .config import Fields, LinearAttentionConfig, ModelConfig, RopeConfig, check_routing, token_ids
from .family import Family
from .hub_names import COMMON_ROWS, GATE_UP_DOWN, LAYER, HubNames

W_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}
HUB_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}
MOE = r"block_sparse_moe\."
KDA_LINEARS = "q_proj|k_proj|v_proj|f_a_proj|f_b_proj|b_proj|g_a_proj|g_b_proj|o_proj"
MLA_LINEARS = "q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj"

ROWS = COMMON_ROWS + [
    (LAYER + MOE + r"experts\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3)\.weight$", "expert", W_PROJ),
    (LAYER + MOE + r"gate\.weight$", "router", None),
    (LAYER + MOE + r"gate\.e_score_correction_bias$", "router_bias", None),
    (LAYER + MOE + r"shared_experts\.(?P<proj>gate|up|down)_proj\.weight$", "shared_expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.(?P<proj>gate|up|down)_proj\.weight$", "dense_mlp", GATE_UP_DOWN),   # first_k_dense_replace
    (LAYER + r"self_attn\.(q_a_layernorm|kv_a_layernorm|o_norm)\.weight$", "norm", None),
    (LAYER + rf"self_attn\.({KDA_LINEARS}|{MLA_LINEARS})\.weight$", "attention", None),
    (LAYER + r"self_attn\.(kv_a_proj_with_mqa|o_proj)\.bias$", "attention", None),        # attention_bias
    # the short convs (channels, 1, kernel), A_log (1, 1, heads, 1) and dt_bias (heads * head_dim,) are not Linears
    # (the GPU-layer encoders quantize 2-D Linear weights only)
    (LAYER + r"self_attn\.(q_conv1d|k_conv1d|v_conv1d)\.weight$", "attention", None),
    (LAYER + r"self_attn\.(A_log|dt_bias)$", "attention", None),
]
EXPERT_NAME = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight"
LAYER_TYPES = ("linear_attention", "full_attention")

# transformers KimiLinearConfig's defaults for the fields read here (tests/test_families.py checks them)
DEFAULTS = {"first_k_dense_replace": 1, "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
            "routed_scaling_factor": 2.446, "num_shared_experts": 1, "q_lora_rank": None,
            "model_max_length": 1048576, "rms_norm_eps": 1e-5, "num_key_value_heads": 32,
            "linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4, "rope_theta": 10000.0}
# linear_attn_config's keys (the hub's spelling) -> transformers 5's top-level fields
LINEAR_KEYS = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
               "short_conv_kernel_size": "linear_conv_kernel_dim"}


def _linear_attn_config(f: Fields) -> dict:
    lac = f.get("linear_attn_config", {})
    f.check(isinstance(lac, dict), f"field 'linear_attn_config' = {lac!r} is not an object")
    return lac


def _linear_attention(f: Fields, lac: dict) -> LinearAttentionConfig:
    """KDA's sizes: linear_attn_config.{num_heads, head_dim, short_conv_kernel_size} (the hub) over transformers'
    linear_num_heads / linear_head_dim / linear_conv_kernel_dim; q, k and v heads alike (one state per head)."""
    d = {}
    for hub, top in LINEAR_KEYS.items():
        v = lac.get(hub)
        if v is not None:
            key = f"linear_attn_config.{hub}"
            f.check(isinstance(v, int) and not isinstance(v, bool), f"field {key!r} = {v!r} is not an integer")
            d[hub] = v
        else:
            d[hub] = f.get(top, DEFAULTS[top], cast=int)
            key = top
        f.check(d[hub] >= 1, f"field {key!r} = {d[hub]} must be >= 1")
    nh, hd = d["num_heads"], d["head_dim"]
    return LinearAttentionConfig(conv_kernel=d["short_conv_kernel_size"], num_k_heads=nh, num_v_heads=nh,
                                 k_head_dim=hd, v_head_dim=hd)


def _layer_types(f: Fields, n_layers: int, lac: dict) -> tuple[str, ...]:
    """Precedence as transformers': layer_types, else linear_attn_config's 1-indexed kda_layers / full_attn_layers
    (together covering every layer once), else every 4th layer from index 4 full attention."""
    def from_hub() -> tuple[str, ...]:
        if "kda_layers" not in lac and "full_attn_layers" not in lac:
            return tuple("full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers))
        types: list[str | None] = [None] * n_layers
        for key, kind in (("kda_layers", "linear_attention"), ("full_attn_layers", "full_attention")):
            layers = lac.get(key)
            f.check(isinstance(layers, list), f"field 'linear_attn_config.{key}' = {layers!r} must list layers "
                                              f"(1-indexed) beside the other of kda_layers / full_attn_layers")
            for n in layers:
                f.check(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= n_layers,
                        f"field 'linear_attn_config.{key}' holds {n!r}: layers are 1..num_hidden_layers={n_layers}")
                f.check(types[n - 1] is None, f"field 'linear_attn_config.{key}': layer {n} is listed twice")
                types[n - 1] = kind
        missing = [i + 1 for i, t in enumerate(types) if t is None]
        f.check(not missing, f"field 'linear_attn_config': layers {missing} are in neither kda_layers nor "
                             f"full_attn_layers")
        return tuple(types)
    return f.layer_types(n_layers, LAYER_TYPES, from_hub)


def _moe_layers(f: Fields, n_layers: int, n_experts: int) -> tuple[int, ...]:
    types = f.get("mlp_layer_types", None)
    if types is None:
        first = f.get("first_k_dense_replace", DEFAULTS["first_k_dense_replace"], cast=int)
        f.check(first >= 0, f"first_k_dense_replace={first} must be >= 0")
        freq = f.get("moe_layer_freq", 1, cast=int)
        f.check(freq >= 1, f"moe_layer_freq={freq} must be >= 1")
        return deepseek_v2.dense_first_moe_layers(n_layers, n_experts, first, freq)
    f.check(isinstance(types, list) and len(types) == n_layers and set(types) <= {"dense", "sparse"},
            f"field 'mlp_layer_types' must list 'dense' or 'sparse' for each of num_hidden_layers={n_layers} layers")
    return tuple(i for i, t in enumerate(types) if t == "sparse" and n_experts)


def parse(f: Fields) -> ModelConfig:
    n_layers, hidden = f.need("num_hidden_layers"), f.need("hidden_size")
    n_experts = f.need("num_experts", "num_local_experts")
    top_k = f.need("num_experts_per_token", "num_experts_per_tok")
    n_group = f.get("num_expert_group", f.get("n_group", DEFAULTS["num_expert_group"], cast=int), cast=int)
    topk_group = f.get("topk_group", DEFAULTS["topk_group"], cast=int)
    f.check(n_group >= 1 and (n_experts % n_group == 0), f"num_experts={n_experts} is not a multiple of "
                                                         f"num_expert_group={n_group}")
    check_routing(f, n_experts, top_k, n_group, topk_group, grouped=True, experts_key="num_experts",
                  sigmoid_groups=True, group_key="num_expert_group")
    act = f.get("moe_router_activation_func", "sigmoid")
    f.check(act == "sigmoid", f"field 'moe_router_activation_func' = {act!r}: Kimi Linear routes by sigmoid")
    f.check(f.get("mla_use_nope", True) is True, "field 'mla_use_nope' is false: Kimi Linear's MLA layers apply no "
                                                 "RoPE (transformers' KimiLinearAttention has none)")
    hidden_act = f.get("hidden_act", "silu")
    f.check(hidden_act == "silu", f"field 'hidden_act' = {hidden_act!r} is not 'silu'")
    lac = _linear_attn_config(f)
    layer_types = _layer_types(f, n_layers, lac)
    nh = f.run("num_attention_heads")
    rope_dim = f.run("qk_rope_head_dim")
    max_position = f.get("model_max_length", f.get("max_position_embeddings", DEFAULTS["model_max_length"],
                                                   cast=int), cast=int)
    theta = f.get("rope_theta", DEFAULTS["rope_theta"], cast=float)
    norm = f.get("moe_renormalize", f.get("norm_topk_prob", DEFAULTS["moe_renormalize"]))
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=f.need("moe_intermediate_size"), moe_layers=_moe_layers(f, n_layers, n_experts),
        attention="mla", vocab_size=f.run("vocab_size"), num_heads=nh,
        num_kv_heads=f.get("num_key_value_heads", DEFAULTS["num_key_value_heads"], cast=int),   # unused by MLA
        head_dim=rope_dim, intermediate_size=f.run("intermediate_size"),
        # NoPE: the rotary table is never applied (ktrun's kimi_linear passes an identity rope); the default kind
        # keeps softmax_scale at (qk_nope + qk_rope)^-1/2 as transformers'
        rope=RopeConfig(theta=theta, dim=rope_dim) if f.for_runtime else None,
        rms_norm_eps=f.get("rms_norm_eps", DEFAULTS["rms_norm_eps"], cast=float), max_position=max_position,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", False)),
        n_shared_experts=f.get("num_shared_experts", f.get("n_shared_experts", DEFAULTS["num_shared_experts"],
                                                           cast=int), cast=int),
        norm_topk_prob=bool(norm),
        routed_scaling_factor=f.get("routed_scaling_factor", DEFAULTS["routed_scaling_factor"], cast=float),
        scoring="sigmoid", topk_method="noaux_tc", n_group=n_group, topk_group=topk_group,
        q_lora_rank=f.get("q_lora_rank", DEFAULTS["q_lora_rank"], cast=int, keep_null=True),
        kv_lora_rank=f.run("kv_lora_rank"), qk_nope_head_dim=f.run("qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
        v_head_dim=f.run("v_head_dim"), layer_types=layer_types, linear_attention=_linear_attention(f, lac),
        bos_token_id=f.raw.get("bos_token_id"), eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw)


FAMILY = Family(
    name="kimi_linear", title="Kimi Linear", architectures=("KimiLinearForCausalLM",), parse=parse,
    names=HubNames(ROWS, EXPERT_NAME, HUB_PROJ,
                   moe_prefix="block_sparse_moe.", shared_prefix="block_sparse_moe.shared_experts."),
    runtime_module="kimi_linear")
