"""Qwen3-Next: a hybrid stack. Most layers run gated DeltaNet linear attention (`linear_attn`: a causal depthwise
conv over q|k|v, then the gated delta rule over a per-request recurrent state); every `full_attention_interval`-th
layer runs gated full attention (`self_attn`: q_proj also yields a sigmoid output gate; per-head q/k RMSNorm; RoPE on
the first partial_rotary_factor of each head). The MoE block is Qwen3-MoE's softmax top-k (renormalized) plus one
shared expert scaled by sigmoid(shared_expert_gate). Every RMSNorm outside the DeltaNet's gated norm is
zero-centred (scales by 1 + weight). Hub checkpoints carry a multi-token-prediction head under `mtp.` (skipped).
GGUF: llama.cpp's `qwen3next` (ssm_* tensors for the DeltaNet); its converter's transforms are undone at read
(`linear_attention_undo`), and Qwen3.5-MoE's `qwen35moe` reuses them.
"""
from __future__ import annotations

import numpy as np

from .config import Fields, LinearAttentionConfig, ModelConfig, check_routing, parse_rope, token_ids
from .family import Family
from .gguf_names import (
    ATTN_NORM_ROWS,
    GLOBAL_ROWS,
    HUB_GATE_UP_DOWN,
    NEXTN_ROW,
    GGUFArch,
    Join,
    Undo,
    expert_rows,
)
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


# --- GGUF: llama.cpp's "qwen3next" ----------------------------------------------------------------------------
# convert_hf_to_gguf's Qwen3NextModel (on float32 copies of the weights): A_log -> ssm_a = -exp(A_log); dt_bias ->
# ssm_dt.bias; conv1d (C, 1, K) squeezed to (C, K); every RMSNorm weight but the DeltaNet's gated norm stored as
# 1 + weight; in_proj_qkvz, grouped per key head as [q k v z], split into attn_qkv (all q | all k | all v, the conv's
# channel order) and attn_gate (all z). The full-attention blocks' q_proj (queries and output gate interleaved per
# head) and everything else are written as they are. MTP blocks follow the main ones (skipped).
def _unit_norm(a, cfg):                  # the converter stored 1 + weight (float32): exact for weights in bf16
    return a - np.float32(1.0)


def _a_log(a, cfg):                      # ssm_a = -exp(A_log) in float32; log in float64, rounded once
    return np.log(-a.astype(np.float64)).astype(np.float32)


def _conv_shape(shape, cfg):             # (C, K) -> the hub's (C, 1, K)
    return (shape[0], 1, shape[1])


def text_cfg(cfg: dict) -> dict:
    """The text model's config.json dict (Qwen3.5-MoE nests it under text_config)."""
    return cfg.get("text_config", cfg)


def linear_attention_undo(reorder_v: bool) -> list:
    """(hub name regex, Undo) rows for a Qwen3-Next-style DeltaNet stack as llama.cpp's converter writes it;
    reorder_v: Qwen3.5's value heads, which the converter reorders from grouped-by-key-head to tiled."""
    def heads(cfg):
        t = text_cfg(cfg)
        nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        return nk, nv // nk, t["linear_key_head_dim"], t["linear_value_head_dim"]

    def untile(a, axis, cfg, head_dim):
        """Undo convert_hf_to_gguf's _reorder_v_heads: [r][nk][d] (tiled) back to [nk][r][d] along `axis`."""
        if not reorder_v:
            return a
        nk, r, _, _ = heads(cfg)
        if r == 1:
            return a
        a = np.moveaxis(a, axis, 0)
        rest = a.shape[1:]
        a = a.reshape(r, nk, head_dim, *rest).swapaxes(0, 1).reshape(nk * r * head_dim, *rest)
        return np.ascontiguousarray(np.moveaxis(a, 0, axis))

    def v_rows(head_dim_of, skip_qk: bool, axis: int = 0):
        def fn(a, cfg):
            nk, _, dk, dv = heads(cfg)
            head_dim = head_dim_of(dv)
            if not skip_qk:
                return untile(a, axis, cfg, head_dim)
            qk = 2 * nk * dk
            return np.concatenate([a[:qk], untile(a[qk:], 0, cfg, head_dim)], axis=0)
        return fn

    conv = v_rows(lambda dv: dv, skip_qk=True)
    rows = [
        (r"linear_attn\.A_log$", Undo(lambda a, cfg: untile(_a_log(a, cfg), 0, cfg, 1))),
        (r"linear_attn\.conv1d\.weight$", Undo(lambda a, cfg: conv(a, cfg).reshape(_conv_shape(a.shape, cfg)),
                                                 _conv_shape)),
        (r"(?<!linear_attn\.)norm\.weight$", Undo(_unit_norm)),
    ]
    if reorder_v:
        rows += [
            (r"linear_attn\.dt_bias$", Undo(lambda a, cfg: untile(a, 0, cfg, 1))),
            (r"linear_attn\.in_proj_qkv\.weight$", Undo(v_rows(lambda dv: dv, skip_qk=True))),
            (r"linear_attn\.in_proj_z\.weight$", Undo(v_rows(lambda dv: dv, skip_qk=False))),
            (r"linear_attn\.in_proj_[ab]\.weight$", Undo(v_rows(lambda dv: 1, skip_qk=False))),
            (r"linear_attn\.out_proj\.weight$", Undo(v_rows(lambda dv: dv, skip_qk=False, axis=1))),
        ]
    return rows


def _qkvz_shape(parts: dict, cfg: dict) -> tuple:
    return (parts["qkv"][0] + parts["z"][0], parts["qkv"][1])


def _qkvz(parts: dict, cfg: dict):
    """attn_qkv (all q | all k | all v) + attn_gate (all z) -> in_proj_qkvz grouped per key head as [q k v z]."""
    qkv, z = parts["qkv"], parts["z"]
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    h = qkv.shape[1]
    q, k, v = qkv[:nk * dk], qkv[nk * dk:2 * nk * dk], qkv[2 * nk * dk:]
    per_head = [x.reshape(nk, -1, h) for x in (q, k, v, z)]
    return np.concatenate(per_head, axis=1).reshape(-1, h)


QKVZ = Join(("qkv", "z"), _qkvz_shape, _qkvz)


def gguf_rows(root: str, fused_in_proj: bool) -> list:
    """The tensor rows shared by qwen3next and qwen35moe; root: where the decoder sits in the hub ("model.")."""
    la = "model.layers.{L}.linear_attn."
    rows = GLOBAL_ROWS + ATTN_NORM_ROWS[:1] + expert_rows("mlp", HUB_GATE_UP_DOWN) + [
        (r"blk\.(?P<L>\d+)\.post_attention_norm\.weight", "model.layers.{L}.post_attention_layernorm.weight"),
        (r"blk\.(?P<L>\d+)\.attn_q_norm\.weight", "model.layers.{L}.self_attn.q_norm.weight"),
        (r"blk\.(?P<L>\d+)\.attn_k_norm\.weight", "model.layers.{L}.self_attn.k_norm.weight"),
        (r"blk\.(?P<L>\d+)\.attn_output\.weight", "model.layers.{L}.self_attn.o_proj.weight"),
        (r"blk\.(?P<L>\d+)\.ffn_gate_inp\.weight", "model.layers.{L}.mlp.gate.weight"),
        (r"blk\.(?P<L>\d+)\.ffn_gate_inp_shexp\.weight", "model.layers.{L}.mlp.shared_expert_gate.weight"),
        (r"blk\.(?P<L>\d+)\.ssm_a", la + "A_log"),
        (r"blk\.(?P<L>\d+)\.ssm_dt\.bias", la + "dt_bias"),
        (r"blk\.(?P<L>\d+)\.ssm_conv1d\.weight", la + "conv1d.weight"),
        (r"blk\.(?P<L>\d+)\.ssm_norm\.weight", la + "norm.weight"),
        (r"blk\.(?P<L>\d+)\.ssm_out\.weight", la + "out_proj.weight"),
        NEXTN_ROW,
    ] + [(rf"blk\.(?P<L>\d+)\.attn_{p}\.weight", f"model.layers.{{L}}.self_attn.{p}_proj.weight") for p in "qkv"] + [
        (rf"blk\.(?P<L>\d+)\.ffn_{p}_shexp\.weight", f"model.layers.{{L}}.mlp.shared_expert.{p}_proj.weight")
        for p in ("gate", "up", "down")]
    if fused_in_proj:       # Qwen3-Next
        rows += [(r"blk\.(?P<L>\d+)\.attn_qkv\.weight", la + "in_proj_qkvz.weight", QKVZ, "qkv"),
                 (r"blk\.(?P<L>\d+)\.attn_gate\.weight", la + "in_proj_qkvz.weight", QKVZ, "z"),
                 (r"blk\.(?P<L>\d+)\.ssm_ba\.weight", la + "in_proj_ba.weight")]
    else:                   # Qwen3.5: four plain Linears
        rows += [(r"blk\.(?P<L>\d+)\.attn_qkv\.weight", la + "in_proj_qkv.weight"),
                 (r"blk\.(?P<L>\d+)\.attn_gate\.weight", la + "in_proj_z.weight"),
                 (r"blk\.(?P<L>\d+)\.ssm_beta\.weight", la + "in_proj_b.weight"),
                 (r"blk\.(?P<L>\d+)\.ssm_alpha\.weight", la + "in_proj_a.weight")]
    if root != "model.":
        rows = [(r[0], r[1].replace("model.", root, 1) if r[1].startswith("model.") else r[1], *r[2:]) for r in rows]
    return rows


def gguf_text_config(m, cfg: dict, names: frozenset) -> dict:
    """The text config (Qwen3-Next's field names) of a qwen3next / qwen35moe GGUF."""
    n_mtp = m.a("nextn_predict_layers", 0)
    n_layers = cfg["num_hidden_layers"] - n_mtp                   # llama.cpp counts the MTP blocks too
    head_dim = m.a("attention.key_length")
    nv = m.a("ssm.time_step_rank")
    recurrent = m.a("attention.recurrent_layers", None)
    if recurrent is not None:
        layer_types = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:n_layers]]
    else:
        interval = m.a("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    cfg.update({
        "num_hidden_layers": n_layers, "head_dim": head_dim, "layer_types": layer_types,
        "full_attention_interval": m.a("full_attention_interval", 4),
        "partial_rotary_factor": m.a("rope.dimension_count") / head_dim,
        "intermediate_size": m.a("feed_forward_length", None),
        "moe_intermediate_size": m.a("expert_feed_forward_length"),
        "shared_expert_intermediate_size": m.a("expert_shared_feed_forward_length", 0),
        "num_experts": m.a("expert_count"), "num_experts_per_tok": m.a("expert_used_count"),
        "linear_conv_kernel_dim": m.a("ssm.conv_kernel"), "linear_key_head_dim": m.a("ssm.state_size"),
        "linear_num_key_heads": m.a("ssm.group_count"), "linear_num_value_heads": nv,
        "linear_value_head_dim": m.a("ssm.inner_size") // nv,
    })
    return cfg


def _qwen3next_config(m, cfg: dict, names: frozenset) -> dict:
    cfg = gguf_text_config(m, cfg, names)
    # llama.cpp's qwen3next has no dense-MLP layers (no mlp_only_layers) and always renormalizes the top-k weights
    cfg.update({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "mlp_only_layers": [],
                "decoder_sparse_step": 1, "norm_topk_prob": True})
    return cfg


GGUF = GGUFArch("qwen3next", gguf_rows("model.", fused_in_proj=True), _qwen3next_config,
                undo=linear_attention_undo(reorder_v=False))

FAMILY = Family(
    name="qwen3_next", title="Qwen3-Next", architectures=("Qwen3NextForCausalLM",), parse=parse,
    names=HubNames(ROWS, "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight", GATE_UP_DOWN,
                   moe_prefix="mlp.", shared_prefix="mlp.shared_expert."),
    runtime_module="qwen3_next", gguf=GGUF)
