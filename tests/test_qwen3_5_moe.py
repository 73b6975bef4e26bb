"""Qwen3.5-MoE (Qwen3-Next's hybrid text model with unfused DeltaNet projections, wrapped with a vision tower) in
ktrun against transformers' Qwen3_5MoeForConditionalGeneration: the release's layout converts (text_config nesting,
model.language_model. names, the vision tower skipped), the stack's numerics, the engine's per-request state,
KV blocks, bf16 and GPTQ are checked with Qwen3-Next's in tests/test_hybrid_runtime.py."""
from __future__ import annotations

import json

from runtime_helpers import INIT_SCALE

from ktconvert.sources import open_source
from ktconvert.testing import make_checkpoint


def test_release_layout_is_read(tmp_path):
    """config.json nests the text model under text_config (rope_parameters with an M-RoPE section); tensors sit
    under model.language_model., the vision tower under model.visual. is skipped, nothing else is."""
    src = make_checkpoint("qwen3_5_moe", tmp_path / "src", init_scale=INIT_SCALE, num_layers=4,
                          full_attention_interval=4)
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["text_config"]["rope_parameters"]["mrope_section"]
    s = open_source(src)
    roles = {n: s.arch.classify(n) for n in s.tensor_names()}
    skipped = {n for n, r in roles.items() if r.kind == "skip"}
    assert skipped and all(n.startswith("model.visual.") for n in skipped)
    assert roles["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"].kind == "attention"
    assert roles["model.language_model.layers.3.mlp.experts.7.down_proj.weight"].kind == "expert"
    assert roles["lm_head.weight"].kind == "head"
    assert s.arch.moe_layers() == [0, 1, 2, 3]
