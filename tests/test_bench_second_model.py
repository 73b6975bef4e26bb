"""bench/second_model.py (the quality bench's second model shape), as a real subprocess in its smoke size: it writes a
complete hub checkpoint that transformers reads as a Qwen3-MoE with the hub's per-expert names, its own read-back
check passed, and a second run leaves a finished checkpoint alone."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "second_model.py"


def test_second_model_smoke_run_writes_a_qwen3_moe_hub_checkpoint(tmp_path):
    out = tmp_path / "qwen3-small"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--steps", "2", "--limit-files", "40"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen3-small"]          # no .partial left beside it
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (16, 4, 256)
    stats = json.loads((out / "training_stats.json").read_text())
    assert stats["steps"] == 2 and stats["readback_max_abs_dlogit"] <= 1e-3
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.3.mlp.experts.15.down_proj.weight").get_shape() == [256, 256]
    assert "model.layers.0.mlp.gate.weight" in names and "model.layers.0.self_attn.k_norm.weight" in names
    # the tokenizer is the default model's (the bench compares both models on identical tokens)
    default = Path(__file__).resolve().parents[1] / "ktconvert" / "data" / "default_model" / "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == default.read_bytes()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0 and "already written" in again.stdout
