"""MiMo-V2-Flash (Xiaomi, model_type mimo_v2_flash): GQA attention in two layer kinds. "sliding_attention" layers see
the last `sliding_window` keys, have twice the full layers' kv heads (swa_num_key_value_heads), their own RoPE theta
(swa_rope_theta) and a learned sink logit per head (`self_attn.attention_sink_bias`, add_swa_attention_sink_bias);
"full_attention" layers see every key and have no sinks (add_full_attention_sink_bias false). Queries and keys have
head_dim (192 in the release) dims, values v_head_dim (128); values are multiplied by attention_value_scale (0.707)
before attention; RoPE covers the first partial_rotary_factor (0.334) of each q/k head (halves layout). The MoE block
is sigmoid routing with e_score_correction_bias (noaux_tc, one group in the release), weights renormalized, no shared
experts; the first layer (moe_layer_freq / mlp_layer_types) is a dense MLP. The release also ships multi-token-
prediction layers under `model.mtp.` (skipped: ktrun decodes without them).

config.json comes in two spellings, both read here: the release's (remote-code) keys hybrid_layer_pattern (1 =
sliding), moe_layer_freq (1 = MoE), rope_theta / swa_rope_theta / partial_rotary_factor, sliding_window_size,
layernorm_epsilon, swa_* head counts; and transformers 5's layer_types, mlp_layer_types, rope_parameters per layer
kind, sliding_window, rms_norm_eps. Where both are present they must agree. The window: transformers reads the
release's sliding_window_size as that many previous keys plus the query (window = sliding_window_size + 1), and so
does this file; a config with sliding_window only gives the window itself (keys including the query).
"""
from __future__ import annotations

from .config import Fields, ModelConfig, SlidingAttention, check_routing, parse_rope, rotary_dims, token_ids
from .family import Family
from .hub_names import COMMON_ROWS, GATE_UP_DOWN, LAYER, MTP_REASON, HubNames

KINDS = ("full_attention", "sliding_attention")     # hybrid_layer_pattern's 0 and 1
MLP_KINDS = ("dense", "sparse")                     # moe_layer_freq's 0 and 1

ROWS = COMMON_ROWS + [
    (r"model\.mtp\..*", "skip", None, MTP_REASON),
    (LAYER + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$", "expert", GATE_UP_DOWN),
    (LAYER + r"mlp\.gate\.weight$", "router", None),
    (LAYER + r"mlp\.gate\.e_score_correction_bias$", "router_bias", None),
    (LAYER + r"mlp\.(?P<proj>gate|up|down)_proj\.weight$", "dense_mlp", GATE_UP_DOWN),
    (LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$", "attention", None),
    (LAYER + r"self_attn\.attention_sink_bias$", "attention", None),   # (num_heads,): not a Linear, kept as stored
]

# transformers MiMoV2FlashConfig's defaults for the fields read here (tests/test_families.py checks them); the
# rope thetas and partial rotary are its per-kind rope_parameters defaults
DEFAULTS = {"num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "sliding_window": 129, "attention_value_scale": 0.707, "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.334,
            "rope_theta": {"full_attention": 5_000_000.0, "sliding_attention": 10_000.0},
            "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False}
# the release's spelling of one kind's rope theta
THETA_KEY = {"full_attention": "rope_theta", "sliding_attention": "swa_rope_theta"}


def _kinds_from_pattern(f: Fields, key: str, n_layers: int, names: tuple[str, str]) -> tuple[str, ...] | None:
    """A release list of 0/1 per layer (hybrid_layer_pattern, moe_layer_freq) as names[0] / names[1]."""
    pattern = f.get(key, None)
    if pattern is None:
        return None
    f.check(isinstance(pattern, list) and len(pattern) == n_layers,
            f"field {key!r} must list one 0/1 per layer (num_hidden_layers={n_layers}), got {pattern!r}")
    for i, v in enumerate(pattern):
        f.check(type(v) is int and v in (0, 1), f"field {key!r}[{i}] = {v!r} is not 0 or 1")
    return tuple(names[int(v)] for v in pattern)


def _per_layer(f: Fields, n_layers: int, hf_key: str, hub_key: str, allowed: tuple[str, str], default):
    """transformers' list of names (hf_key) or the release's 0/1 list (hub_key); both present: they must agree."""
    hub = _kinds_from_pattern(f, hub_key, n_layers, allowed)
    if f.raw.get(hf_key) is None:
        return hub if hub is not None else default()
    types = f.get(hf_key, None)
    f.check(isinstance(types, list) and len(types) == n_layers,
            f"field {hf_key!r} must list one type per layer (num_hidden_layers={n_layers}), got {types!r}")
    for i, t in enumerate(types):
        f.check(t in allowed, f"field {hf_key!r}[{i}] = {t!r} is not one of {', '.join(allowed)}")
    f.check(hub is None or hub == tuple(types), f"field {hf_key!r} = {types!r} disagrees with {hub_key!r}")
    return tuple(types)


def _window(f: Fields) -> int:
    if f.raw.get("sliding_window_size") is not None:      # the release: previous keys, the query comes on top
        size = f.get("sliding_window_size", None, cast=int)
        f.check(size >= 0, f"field 'sliding_window_size' = {size} must be >= 0")
        return size + 1
    window = f.get("sliding_window", DEFAULTS["sliding_window"], cast=int)
    f.check(window >= 1, f"field 'sliding_window' = {window} must be >= 1")
    return window


def _rope(f: Fields, kind: str, head_dim: int | None, max_position: int):
    """One layer kind's RoPE: transformers' rope_parameters[kind], else the release's top-level keys (a flat
    rope_parameters / rope_scaling is the full layers' rope there)."""
    params = f.raw.get("rope_parameters")
    nested = isinstance(params, dict) and any(k in params for k in KINDS)
    if nested:
        p = params.get(kind)
        f.check(isinstance(p, dict), f"field 'rope_parameters' has no {kind!r} entry")
        p = dict(p)
    else:
        flat = params if isinstance(params, dict) else f.raw.get("rope_scaling")
        p = dict(flat) if isinstance(flat, dict) and kind == "full_attention" else {}
        theta = f.get(THETA_KEY[kind], None, cast=float)
        if theta is not None:
            p.setdefault("rope_theta", theta)
        if f.raw.get("partial_rotary_factor") is not None:
            p.setdefault("partial_rotary_factor", f.raw["partial_rotary_factor"])
    p.setdefault("rope_theta", DEFAULTS["rope_theta"][kind])
    p.setdefault("partial_rotary_factor", DEFAULTS["partial_rotary_factor"])
    rope_type = p.get("rope_type", p.get("type", "default")) or "default"
    # transformers' MiMo attention scales logits by head_dim^-0.5 whatever the rope: only plain RoPE keeps ours equal
    f.check(rope_type == "default", f"rope type {rope_type!r} of the {kind} layers is not supported (default)")
    kf = Fields({"rope_parameters": p}, f"{f.where} ({kind} rope)", f.model_type, f.for_runtime)
    return parse_rope(kf, rotary_dims(kf, head_dim, DEFAULTS["partial_rotary_factor"]), p["rope_theta"], max_position)


def _same(f: Fields, swa_key: str, key: str, value) -> None:
    """A swa_* field must equal its full-layer twin: transformers' class has one value for both kinds."""
    swa = f.get(swa_key, value, cast=int)
    f.check(swa == value, f"field {swa_key!r} = {swa} differs from {key!r} = {value}: sliding layers with their own "
                          f"{key} are not supported (transformers' MiMoV2FlashForCausalLM has one)")


def parse(f: Fields) -> ModelConfig:
    n_layers, hidden = f.need("num_hidden_layers"), f.need("hidden_size")
    n_experts, top_k = f.need("n_routed_experts", "num_local_experts"), f.need("num_experts_per_tok")
    n_group = f.get("n_group", DEFAULTS["n_group"], cast=int)
    topk_group = f.get("topk_group", DEFAULTS["topk_group"], cast=int)
    check_routing(f, n_experts, top_k, n_group, topk_group, grouped=True, sigmoid_groups=True)
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("hidden_act", "silu")):
        got = f.get(key, want)
        f.check(got == want, f"field {key!r} = {got!r} is not {want!r} (the only one MiMo-V2-Flash has)")
    shared = f.get("n_shared_experts", 0, cast=int)
    f.check(shared == 0, f"field 'n_shared_experts' = {shared}: MiMo-V2-Flash has no shared experts")
    layer_types = _per_layer(f, n_layers, "layer_types", "hybrid_layer_pattern", KINDS, lambda: tuple(
        "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)))
    mlp_types = _per_layer(f, n_layers, "mlp_layer_types", "moe_layer_freq", MLP_KINDS,
                           lambda: ("dense",) + ("sparse",) * (n_layers - 1))
    max_position = f.get("max_position_embeddings", DEFAULTS["max_position_embeddings"], cast=int)
    nh = f.run("num_attention_heads")
    nkv = hd = vd = swa_nkv = None
    if nh is not None:
        nkv = f.get("num_key_value_heads", DEFAULTS["num_key_value_heads"], cast=int)
        f.check(nkv >= 1 and nh % nkv == 0, f"num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}")
        swa_nkv = f.get("swa_num_key_value_heads", 2 * nkv, cast=int)     # transformers: twice the full layers'
        f.check(swa_nkv >= 1 and nh % swa_nkv == 0,
                f"num_attention_heads={nh} is not a multiple of swa_num_key_value_heads={swa_nkv}")
        # the KV cache holds max(nkv, swa_nkv) heads per layer; the fewer heads are repeated up to it
        f.check(max(nkv, swa_nkv) % min(nkv, swa_nkv) == 0, f"swa_num_key_value_heads={swa_nkv} and "
                                                            f"num_key_value_heads={nkv}: one must divide the other")
        hd = f.get("head_dim", DEFAULTS["head_dim"], cast=int)
        vd = f.get("v_head_dim", DEFAULTS["v_head_dim"], cast=int)
        f.check(hd >= 1 and vd >= 1, f"head_dim={hd} and v_head_dim={vd} must be >= 1")
        _same(f, "swa_num_attention_heads", "num_attention_heads", nh)
        _same(f, "swa_head_dim", "head_dim", hd)
        _same(f, "swa_v_head_dim", "v_head_dim", vd)
    value_scale = f.get("attention_value_scale", DEFAULTS["attention_value_scale"], cast=float, keep_null=True)
    value_scale = 1.0 if value_scale is None else value_scale      # null: unscaled (transformers' reading)
    eps = f.get("rms_norm_eps", None, cast=float)
    eps = f.get("layernorm_epsilon", DEFAULTS["rms_norm_eps"], cast=float) if eps is None else eps
    sinks = {k: bool(f.get(k, DEFAULTS[k])) for k in ("add_swa_attention_sink_bias", "add_full_attention_sink_bias")}
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=f.need("moe_intermediate_size"),
        moe_layers=tuple(i for i, t in enumerate(mlp_types) if t == "sparse" and n_experts),
        attention="gqa", vocab_size=f.run("vocab_size"), num_heads=nh, num_kv_heads=nkv, head_dim=hd, v_head_dim=vd,
        intermediate_size=f.run("intermediate_size"),
        rope=_rope(f, "full_attention", hd, max_position), rms_norm_eps=eps, max_position=max_position,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", False)), sliding_window=_window(f), layer_types=layer_types,
        attention_sinks=sinks["add_full_attention_sink_bias"],
        sliding_attention=SlidingAttention(num_kv_heads=swa_nkv, rope=_rope(f, "sliding_attention", hd, max_position),
                                           sinks=sinks["add_swa_attention_sink_bias"]),
        value_scale=value_scale, n_mtp_layers=f.get("num_nextn_predict_layers", 0, cast=int),
        norm_topk_prob=bool(f.get("norm_topk_prob", DEFAULTS["norm_topk_prob"])),
        routed_scaling_factor=f.get("routed_scaling_factor", DEFAULTS["routed_scaling_factor"], cast=float),
        scoring="sigmoid", topk_method="noaux_tc", n_group=n_group, topk_group=topk_group,
        bos_token_id=f.raw.get("bos_token_id"), eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw)


FAMILY = Family(
    name="mimo_v2_flash", title="MiMo-V2-Flash", architectures=("MiMoV2FlashForCausalLM",), parse=parse,
    names=HubNames(ROWS, "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight", GATE_UP_DOWN,
                   moe_prefix="mlp."),
    runtime_module="mimo_v2_flash")
