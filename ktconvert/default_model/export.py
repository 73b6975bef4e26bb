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
    out = {}
    for name, t in model.state_dict().items():
        if "rotary_emb" in name:
            continue
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


def write_configs(out_dir: Path, model) -> None:
    from transformers import GenerationConfig

    cfg = model.config.to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
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
