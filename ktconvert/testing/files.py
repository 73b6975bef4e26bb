"""How the fixture factory lays tensors and config out on disk, hub style: dtypes, shards + index, config.json."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ktconvert.testing.families import FIXTURES

FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}
# Linear weights the FP8 releases ship as FP8 (everything else stays BF16; e_score_correction_bias stays F32):
# attention projections (DeepSeek's MLA and its V3.2 indexer's wq_b / wk; MiniMax's q/k/v/o), experts, shared experts
# and dense MLPs (DeepSeek's gate/up/down_proj, MiniMax's block_sparse_moe w1/w2/w3).
_FP8_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|q_proj|k_proj|v_proj|kv_a_proj_with_mqa"
                         r"|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)|mlp\.(experts\.\d+\.|shared_experts\.)?"
                         r"(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
F32_TENSORS = re.compile(r".*\.e_score_correction_bias$")
_DROP = ("output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
         "label2id", "problem_type", "_name_or_path", "output_attentions", "dtype", "qk_head_dim")


def _text_hub_config(d: dict, fixture) -> dict:
    """The text model's keys as the hub writes them (rope back in rope_theta / rope_scaling, partial rotary at the
    top level, renames, hub-only keys)."""
    for k in _DROP + fixture.hub_drop_keys:   # e.g. DeepSeek's head_dim: derived, the hub's configs do not carry it
        d.pop(k, None)
    if fixture.hub_rope_parameters:   # config.json keeps transformers v5's rope_parameters as written
        d.update(fixture.hub_extra_keys)
        return d
    rope = d.pop("rope_parameters", None) or {}
    d["rope_theta"] = rope.get("rope_theta", 10000.0)
    partial = rope.pop("partial_rotary_factor", None)
    if fixture.partial_rotary_key == "partial_rotary_factor":
        d["partial_rotary_factor"] = partial
    elif fixture.partial_rotary_key == "rotary_dim":
        d["rotary_dim"] = int(d["head_dim"] * partial)
    if rope.get("rope_type", "default") != "default":
        d["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rope.items() if k != "rope_theta"}
    for ours, hub in fixture.hub_key_renames.items():
        d[hub] = d.pop(ours)
    d.update(fixture.hub_extra_keys)
    return d


def hub_config(config, arch: str, fp8: bool) -> dict:
    """config.json as the hub has it for this model type (transformers v5 names mapped back, hub-only keys added)."""
    d = config.to_dict()
    fixture = FIXTURES[arch]
    if fixture.text_config_key:
        for k in _DROP:
            d.pop(k, None)
        d[fixture.text_config_key] = dict(sorted(_text_hub_config(d[fixture.text_config_key], fixture).items()))
    else:
        d = _text_hub_config(d, fixture)
    d["architectures"] = [fixture.architecture or type(config).__name__.replace("Config", "ForCausalLM")]
    d["torch_dtype"] = "bfloat16"
    if fp8:
        d["quantization_config"] = {**FP8_QUANTIZATION_CONFIG, **fixture.fp8_config}
    return dict(sorted(d.items()))


def to_hub_dtype(name: str, t: torch.Tensor, fp8: bool, block, pow2_scales: bool = False) -> dict[str, torch.Tensor]:
    """One tensor as stored on the hub: bf16, f32 router bias, or FP8 + weight_scale_inv (power-of-two scales for
    quantization_config scale_fmt "ue8m0")."""
    if F32_TENSORS.match(name):
        return {name: t.float().contiguous()}
    if fp8 and _FP8_WEIGHT.match(name):
        from ktconvert.sources.fp8 import quantize_fp8_block

        bits, scale_inv = quantize_fp8_block(t.float().numpy(), tuple(block), pow2_scales)
        return {name: torch.from_numpy(bits).view(torch.float8_e4m3fn),
                name + "_scale_inv": torch.from_numpy(scale_inv)}
    return {name: t.to(torch.bfloat16).contiguous()}


def write_shards(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    """Greedy sharding in module order (a tensor never splits), hub file names, sorted index weight_map."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
