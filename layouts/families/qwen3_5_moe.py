"""Qwen3.5-MoE (model_type qwen3_5_moe): Qwen3-Next's hybrid text model (gated DeltaNet linear attention in most
layers, gated full attention every full_attention_interval-th, softmax top-k renormalized + a sigmoid-gated shared
expert, zero-centred RMSNorms) wrapped with a vision tower, as the releases ship it:
- config.json holds the text model's config under `text_config` (model_type qwen3_5_moe_text) beside
  `vision_config`; rope sits in text_config.rope_parameters with partial_rotary_factor and an interleaved M-RoPE
  section. For text the three M-RoPE position streams are the same position, so it is plain RoPE on the first
  partial_rotary_factor of each head (what ktrun runs; images are not read).
- the decoder's tensors sit under `model.language_model.` (lm_head.weight at the top), the vision tower under
  `model.visual.` (skipped: ktrun serves the text model), the multi-token-prediction head under `mtp.` (skipped).
- the DeltaNet's input projection is four plain Linears, in_proj_qkv (q | k | v, the conv's channel order),
  in_proj_z, in_proj_b, in_proj_a, where Qwen3-Next fuses them per key head (in_proj_qkvz, in_proj_ba).
- every layer is MoE (no decoder_sparse_step / mlp_only_layers) and top-k weights are always renormalized.
Routed experts: the releases store each layer's experts fused, `mlp.experts.gate_up_proj` (E, 2I, H) with gate in
rows [0, I) and up in [I, 2I), and `mlp.experts.down_proj` (E, H, I) (transformers' Qwen3_5MoeExperts); the converter
reads them one expert at a time (FusedExperts, ktconvert.sources.fused_experts). transformers' save_pretrained
writes per-expert names (`experts.N.gate_proj.weight`) instead, which are read as they are.
GGUF: llama.cpp's `qwen35moe` (text model only; the vision tower goes to a separate mmproj file): Qwen3-Next's
converter transforms plus the value heads reordered from grouped-by-key-head to tiled, all undone at read.
"""
from __future__ import annotations

import dataclasses

from . import qwen3_next
from .config import Fields, ModelConfig
from .family import Family
from .gguf_names import GGUFArch
from .hub_names import COMMON_ROWS, GATE_UP_DOWN, LAYER, FusedExperts, HubNames

ROOT = "model.language_model."
TEXT_MODEL_TYPES = ("qwen3_5_moe_text",)
VISION = "vision tower (ktrun serves Qwen3.5-MoE as a text model)"


def _under_root(rows: list) -> list:
    """Rows written for `model.` decoders, moved under model.language_model. (lm_head and the rest unchanged)."""
    out = []
    for row in rows:
        rx = row[0]
        if rx.startswith(r"model\."):
            rx = r"model\.language_model\." + rx[len(r"model\."):]
        out.append((rx, *row[1:]))
    return out


ROWS = [(r"model\.visual\.", "skip", None, VISION),
        (r"mtp\..*", "skip", None, "multi-token-prediction head (ktrun decodes without it)")] + _under_root(
    COMMON_ROWS + [
        (LAYER + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$", "expert", GATE_UP_DOWN),
        (LAYER + r"mlp\.experts\.(gate_up_proj|down_proj)$", "expert", None),    # fused: all of a layer's experts
        (LAYER + r"mlp\.gate\.weight$", "router", None),
        (LAYER + r"mlp\.shared_expert_gate\.weight$", "shared_expert_gate", None),  # (1, H): kept as the router
        (LAYER + r"mlp\.shared_expert\.(?P<proj>gate|up|down)_proj\.weight$", "shared_expert", GATE_UP_DOWN),
        (LAYER + r"self_attn\.(q_norm|k_norm)\.weight$", "norm", None),
        (LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$", "attention", None),
        (LAYER + r"linear_attn\.norm\.weight$", "norm", None),
        # in_proj_* / out_proj are Linears; conv1d (conv_dim, 1, kernel), A_log and dt_bias (v_heads,) are not
        (LAYER + r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj|conv1d)\.weight$",
         "attention", None),
        (LAYER + r"linear_attn\.(A_log|dt_bias)$", "attention", None),
    ])


# the releases' fused experts: Linear orientation, gate then up; transformers' save_pretrained writes per-expert names
FUSED = FusedExperts(interleaved=False, input_first=False, optional=True)


def text_fields(f: Fields) -> Fields:
    text = f.text_config(TEXT_MODEL_TYPES, TEXT_MODEL_TYPES[0])
    for gone in ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob"):   # Qwen3-Next fields 3.5 dropped
        f.check(gone not in text.raw, f"field 'text_config.{gone}' is a Qwen3-Next field; Qwen3.5-MoE makes every "
                                      f"layer MoE and always renormalizes its top-k weights")
    return text


def parse(f: Fields) -> ModelConfig:
    """The text config read as Qwen3-Next's (the same fields and defaults for what both carry)."""
    cfg = qwen3_next.parse(text_fields(f))
    return dataclasses.replace(cfg, model_type=f.model_type, raw=f.raw)


# --- GGUF: llama.cpp's "qwen35moe" ------------------------------------------------------------------------------
def _qwen35moe_config(m, cfg: dict, names: frozenset) -> dict:
    """The release's nesting: the text model's config (Qwen3-Next's field names, rope in rope_parameters with the
    M-RoPE section llama.cpp writes as rope.dimension_sections) under text_config."""
    text = qwen3_next.gguf_text_config(m, dict(cfg), names)
    sections = list(m.a("rope.dimension_sections", [11, 11, 10, 0]))
    text.update({
        "model_type": TEXT_MODEL_TYPES[0], "tie_word_embeddings": "output.weight" not in names,
        "rope_parameters": {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                            "partial_rotary_factor": text.pop("partial_rotary_factor"),
                            "mrope_section": sections[:3], "mrope_interleaved": True}})
    return {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": {k: v for k, v in text.items() if v is not None},
            "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
            "torch_dtype": cfg["torch_dtype"]}


GGUF = GGUFArch("qwen35moe", qwen3_next.gguf_rows(ROOT, fused_in_proj=False), _qwen35moe_config,
                undo=qwen3_next.linear_attention_undo(reorder_v=True))

FAMILY = Family(
    name="qwen3_5_moe", title="Qwen3.5-MoE", architectures=("Qwen3_5MoeForConditionalGeneration",), parse=parse,
    names=HubNames(ROWS, ROOT + "layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight", GATE_UP_DOWN,
                   moe_prefix="mlp.", shared_prefix="mlp.shared_expert.", model_root=ROOT,
                   fused_experts=FUSED),
    runtime_module="qwen3_5_moe", text_config_key="text_config", gguf=GGUF)
