"""Write the trained default model in the Hugging Face hub layout and check that transformers loads it back exactly.

The in-memory transformers 5 model fuses experts (`mlp.experts.gate_up_proj` (E, 2I, H), `down_proj` (E, H, I));
the hub layout (and every converter) uses per-expert Linear weights `mlp.experts.E.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ktconvert.default_model import data

MAX_SHARD_BYTES = 8 * 1024 * 1024  # gives 3 shards for the ~20 MB model
FP32_NAMES = ("e_score_correction_bias",)  # kept in float32 as in the DeepSeek-V3 release
SHIPPED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors.index.json", "README.md", "training_stats.json", "heldout_eval.txt")


def round_to_shipped_precision(model) -> None:
    """Round weights to BF16 in place (kept in float32 storage) so evaluation sees the shipped values."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and not name.endswith(FP32_NAMES) and "rotary" not in name:
                t.copy_(t.to(torch.bfloat16).float())


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """Fused in-memory names -> hub per-expert names; BF16 except the routing bias."""
    return hub_tensors({k: v for k, v in model.state_dict().items() if "rotary_emb" not in k})


def hub_tensors(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{in-memory name: tensor} -> hub names (fused experts split per expert); BF16 except the routing bias."""
    out = {}
    for name, t in named.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if m is None:
            out[name] = t
        elif m.group(2) == "gate_up_proj":  # (E, 2I, H): rows [0, I) = gate, [I, 2I) = up
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{m.group(1)}.{e}.up_proj.weight"] = t[e, inter:]
        else:  # (E, H, I): Linear (out=H, in=I)
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.down_proj.weight"] = t[e]
    return {k: (v.float() if k.endswith(FP32_NAMES) else v.to(torch.bfloat16)).contiguous().clone()
            for k, v in out.items()}


def write_shards(out_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    shards, current, size = [], {}, 0
    for name in sorted(tensors, key=_natural_key):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensors[name], size + nbytes
    shards.append(current)
    assert len(shards) >= 2, "the default model must be sharded (tests exercise the index)"
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _natural_key(name: str):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def write_tokenizer(out_dir: Path, tok) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": data.BOS, "eos_token": data.EOS, "pad_token": data.PAD,
        "add_bos_token": True, "add_eos_token": False,  # the post-processor in tokenizer.json prepends BOS
        "clean_up_tokenization_spaces": False, "model_max_length": 1024,
        "chat_template": data.CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def hub_config(c) -> dict:
    """config.json in the form deepseek-ai/DeepSeek-V3 ships it, for this model's hyper-parameters: the hub's key set
    and spellings (`rope_scaling` + `rope_theta`, `torch_dtype`, `scoring_func` / `topk_method`, `n_group` /
    `topk_group`, `ep_size`, `moe_layer_freq`, ...) and no transformers-only keys (`rope_parameters`, `head_dim`,
    `id2label`, `return_dict`, ...), so every reader that knows DeepSeek-V3 (llama.cpp's converter, vLLM, SGLang,
    kt-kernel, ktrun, transformers) reads the routing and rope the model was trained with. Left out on purpose:
    `auto_map` (remote code, never shipped or run) and `quantization_config` (the weights are BF16, not FP8).

    The model was trained with plain rope; it is written as YaRN with factor 1 (original_max_position_embeddings =
    max_position_embeddings), DeepSeek-V3's form, which every YaRN implementation reduces to plain rope (interpolated
    and extrapolated frequencies coincide, mscale(1) = 1)."""
    import transformers

    rope = dict(getattr(c, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"hub_config: rope {rope} is not the plain rope the default model is trained with")
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": bool(c.attention_bias),
        "attention_dropout": float(c.attention_dropout),
        "aux_loss_alpha": 0.0, "seq_aux": False,     # no auxiliary loss: bias-based balancing only (train.py)
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "ep_size": 1,
        "first_k_dense_replace": c.first_k_dense_replace, "hidden_act": c.hidden_act, "hidden_size": c.hidden_size,
        "initializer_range": c.initializer_range, "intermediate_size": c.intermediate_size,
        "kv_lora_rank": c.kv_lora_rank, "max_position_embeddings": c.max_position_embeddings,
        "model_type": "deepseek_v3", "moe_intermediate_size": c.moe_intermediate_size, "moe_layer_freq": 1,
        "n_group": c.n_group, "n_routed_experts": c.n_routed_experts, "n_shared_experts": c.n_shared_experts,
        "norm_topk_prob": bool(c.norm_topk_prob), "num_attention_heads": c.num_attention_heads,
        "num_experts_per_tok": c.num_experts_per_tok, "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads, "num_nextn_predict_layers": c.num_nextn_predict_layers,
        "pretraining_tp": 1, "q_lora_rank": c.q_lora_rank, "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": c.max_position_embeddings, "type": "yarn"},
        "rope_theta": float(rope.get("rope_theta", 10000.0)), "routed_scaling_factor": c.routed_scaling_factor,
        "scoring_func": "sigmoid", "tie_word_embeddings": bool(c.tie_word_embeddings), "topk_group": c.topk_group,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": transformers.__version__,
        "use_cache": True, "v_head_dim": c.v_head_dim, "vocab_size": c.vocab_size,
    }


def write_configs(out_dir: Path, model) -> None:
    from transformers import GenerationConfig

    (out_dir / "config.json").write_text(json.dumps(hub_config(model.config), indent=2, sort_keys=True) + "\n")
    gen = GenerationConfig(bos_token_id=data.BOS_ID, eos_token_id=data.EOS_ID, pad_token_id=data.PAD_ID,
                           do_sample=True, temperature=0.6, top_p=0.95)
    gen.save_pretrained(str(out_dir))


def export_hub_dir(out_dir: Path, model, tok, stats: dict, train_counts: np.ndarray, eval_text: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("model-*.safetensors"):
        old.unlink()
    write_shards(out_dir, hub_state_dict(model))
    write_tokenizer(out_dir, tok)
    write_configs(out_dir, model)
    (out_dir / "heldout_eval.txt").write_text(eval_text, encoding="utf-8")
    full = dict(stats, train_token_counts=[int(c) for c in train_counts])
    (out_dir / "training_stats.json").write_text(json.dumps(full) + "\n")
    from ktconvert.default_model.card import model_card

    (out_dir / "README.md").write_text(model_card(model.config, stats), encoding="utf-8")


@torch.no_grad()
def verify_hub_dir(out_dir: Path, model) -> float:
    """Load with from_pretrained (float32) and require the same weights and logits as the in-memory model."""
    from transformers import DeepseekV3ForCausalLM

    loaded = DeepseekV3ForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    mine, theirs = model.state_dict(), loaded.state_dict()
    for name, t in mine.items():
        if "rotary" in name:
            continue
        if not torch.equal(t.float(), theirs[name].float()):
            raise SystemExit(f"error: {out_dir}: tensor {name} differs after from_pretrained")
    model.eval()
    x = torch.randint(5, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    diff = float((model(input_ids=x).logits - loaded(input_ids=x).logits).abs().max())
    if not math.isfinite(diff) or diff > 1e-5:
        raise SystemExit(f"error: {out_dir}: logits differ after from_pretrained (max abs diff {diff})")
    return diff
