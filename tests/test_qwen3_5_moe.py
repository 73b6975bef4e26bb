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


def test_fused_experts_as_the_releases_store_them_are_read_per_expert(tmp_path):
    """The releases keep each layer's experts as two 3-D tensors, `mlp.experts.gate_up_proj` (E, 2I, H) (gate rows
    first) and `mlp.experts.down_proj` (E, H, I). transformers' own class writes that layout with
    save_original_format=False (its default save writes per-expert names): both checkpoints of one model read alike,
    the fused one one expert slab at a time, and converts; a fused tensor of the wrong shape is named."""
    import pytest
    import torch
    from safetensors import safe_open

    from ktconvert.sources.roles import SourceError
    from ktconvert.testing.checkpoints import make_model

    model = make_model("qwen3_5_moe", num_layers=2)
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    model.save_pretrained(tmp_path / "per_expert")
    stored = {k for f in (tmp_path / "fused").glob("*.safetensors") for k in sorted(safe_open(str(f), "pt").keys())}
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in stored
    assert not any(".experts.0." in k for k in stored)
    fused, per = open_source(tmp_path / "fused"), open_source(tmp_path / "per_expert")
    assert sorted(fused.tensor_names()) == sorted(per.tensor_names())
    a, i, h = fused.arch, fused.arch.moe_intermediate_size, fused.arch.hidden_size
    for name in per.tensor_names():
        assert torch.equal(fused.read(name), per.read(name)), name
    slab = fused.info(a.expert_tensor_name(1, 3, "up"))
    assert slab.nbytes == i * h * 4                      # one expert's share of its slab, not the layer's tensor
    exp = model.model.language_model.layers[1].mlp.experts
    assert torch.equal(fused.read(a.expert_tensor_name(1, 3, "up")), exp.gate_up_proj[3, i:].detach())
    assert torch.equal(fused.read(a.expert_tensor_name(1, 3, "down")), exp.down_proj[3].detach())

    bad = tmp_path / "bad"
    bad.mkdir()
    from safetensors.torch import load_file, save_file
    for f in (tmp_path / "fused").iterdir():
        if f.suffix == ".safetensors":
            t = load_file(str(f))
            t = {k: (v.transpose(1, 2).contiguous() if k.endswith("layers.0.mlp.experts.down_proj") else v)
                 for k, v in t.items()}
            save_file(t, str(bad / f.name), metadata={"format": "pt"})
        else:
            (bad / f.name).write_bytes(f.read_bytes())
    with pytest.raises(SourceError, match=r"layers\.0\.mlp\.experts\.down_proj"):
        open_source(bad)
