"""The shipped default model (ktconvert/data/default_model): hub layout, loads in transformers, and its held-out
perplexity matches the model card and is far below the unigram baseline.

Reference implementation: transformers' DeepseekV3ForCausalLM and AutoTokenizer (not our converter or runtime).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ktconvert

MODEL_DIR = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"
SEQ_LEN = 256
EVAL_TOKENS = 4096  # 16 windows of 256 predicted tokens
MAX_BYTES = 25 * 1000 * 1000


@pytest.fixture(scope="module")
def stats():
    return json.loads((MODEL_DIR / "training_stats.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def model():
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()


def eval_tokens(tokenizer) -> torch.Tensor:
    """The fixed held-out slice: consecutive windows of SEQ_LEN+1 tokens, (16, 257)."""
    ids = tokenizer((MODEL_DIR / "heldout_eval.txt").read_text(encoding="utf-8"))["input_ids"]
    n = EVAL_TOKENS // SEQ_LEN
    assert len(ids) > n * SEQ_LEN + 1
    return torch.tensor([ids[i * SEQ_LEN: i * SEQ_LEN + SEQ_LEN + 1] for i in range(n)])


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    logits = model(input_ids=windows[:, :-1]).logits.float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    return math.exp(float(nll))


def test_hub_layout_is_sharded_per_expert_and_small():
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (MODEL_DIR / name).is_file(), name
    index = json.loads((MODEL_DIR / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    total_files = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total_files <= MAX_BYTES, f"default model folder is {total_files} bytes"

    names, nbytes = set(), 0
    for shard in shards:
        with safe_open(str(MODEL_DIR / shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                assert index["weight_map"][name] == shard, name
                t = f.get_tensor(name)
                nbytes += t.numel() * t.element_size()
                want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
                assert t.dtype == want, (name, t.dtype)
                names.add(name)
    assert names == set(index["weight_map"]) and nbytes == index["metadata"]["total_size"]
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names), "fused expert names"

    n_experts, inter, hidden = config["n_routed_experts"], config["moe_intermediate_size"], config["hidden_size"]
    for layer in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp"
        assert f"{prefix}.gate.e_score_correction_bias" in names and f"{prefix}.shared_experts.up_proj.weight" in names
        for e in range(n_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"{prefix}.experts.{e}.{proj}.weight" in names
        with safe_open(str(MODEL_DIR / index["weight_map"][f"{prefix}.experts.0.down_proj.weight"]), "pt") as f:
            assert tuple(f.get_slice(f"{prefix}.experts.0.down_proj.weight").get_shape()) == (hidden, inter)
    assert "model.layers.0.mlp.gate_proj.weight" in names  # first layer is dense


def test_transformers_fuses_the_per_expert_tensors_we_ship(model):
    """transformers' loader maps expert e's gate/up/down onto gate_up_proj[e] / down_proj[e] exactly."""
    index = json.loads((MODEL_DIR / "model.safetensors.index.json").read_text())
    layer = model.config.first_k_dense_replace
    experts = model.model.layers[layer].mlp.experts
    inter = model.config.moe_intermediate_size
    for e in (0, model.config.n_routed_experts - 1):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
            with safe_open(str(MODEL_DIR / index["weight_map"][name]), "pt") as f:
                shipped = f.get_tensor(name).float()
            fused = {"gate_proj": experts.gate_up_proj[e, :inter], "up_proj": experts.gate_up_proj[e, inter:],
                     "down_proj": experts.down_proj[e]}[proj]
            assert torch.equal(shipped, fused), name
    bias = model.model.layers[layer].mlp.gate.e_score_correction_bias
    assert float(bias.abs().max()) > 0, "aux-loss-free balancing should have moved the routing bias"


def test_heldout_perplexity_matches_card_and_beats_unigram(model, tokenizer, stats):
    windows = eval_tokens(tokenizer)
    ppl = perplexity(model, windows)
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    assert f"{stats['eval_slice_ppl']:.3f}" in card  # the card states the number this test checks
    assert ppl == pytest.approx(stats["eval_slice_ppl"], rel=0.01), ppl

    counts = np.asarray(stats["train_token_counts"], dtype=np.float64)
    assert len(counts) == model.config.vocab_size
    p = (counts + 1.0) / (counts.sum() + len(counts))  # add-one unigram fitted on the training split
    unigram_ppl = float(np.exp(-np.log(p[windows[:, 1:].numpy().reshape(-1)]).mean()))
    assert unigram_ppl == pytest.approx(stats["unigram_ppl_eval_slice"], rel=1e-3)
    assert ppl < 0.25 * unigram_ppl, (ppl, unigram_ppl)


def test_bf16_compute_stays_close(tokenizer, stats):
    from transformers import DeepseekV3ForCausalLM

    bf16 = DeepseekV3ForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.bfloat16).eval()
    ppl = perplexity(bf16, eval_tokens(tokenizer)[:4])
    assert ppl < 1.1 * stats["eval_slice_ppl"] * 1.5  # 4 windows only: loose, but far from the unigram value
    assert ppl < 0.5 * stats["unigram_ppl_eval_slice"]


def test_tokenizer_bos_and_chat_template(tokenizer):
    ids = tokenizer("import os\n")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == 0 and ids.count(0) == 1  # add_bos_token: exactly one BOS
    assert tokenizer.decode(ids, skip_special_tokens=True) == "import os\n"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function `f(x)`"}],
                                         tokenize=False, add_generation_prompt=True)
    assert chat == "<｜begin▁of▁sentence｜><｜User｜>Write a Python function `f(x)`<｜Assistant｜>"
    chat_ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert chat_ids[0] == 0 and chat_ids.count(0) == 1 and chat_ids[-1] == tokenizer.convert_tokens_to_ids(
        "<｜Assistant｜>")


def test_greedy_generation_looks_like_python(model, tokenizer):
    ids = tokenizer("def read_lines(path):\n    ", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    hits = [w for w in ("return", "self", "if ", "(", ")", "=", ":", "\n    ") if w in text]
    assert len(hits) >= 3 and re.search(r"[A-Za-z_]{3,}", text), repr(text)


def test_converted_default_model_runs_in_ktrun_close_to_transformers(model, tokenizer, tmp_path):
    """The main job's path: `ktconvert quantize` (int4 experts, subprocess) then ktrun, vs transformers BF16."""
    import subprocess
    import sys

    from ktrun.engine import Engine
    from ktrun.models.kv_cache import Batch

    out = tmp_path / "converted"
    r = subprocess.run([sys.executable, "-c", "from ktconvert.cli import main; main()", "quantize", str(MODEL_DIR),
                        "-o", str(out), "--method", "int4-amx", "--quiet"], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    ids = eval_tokens(tokenizer)[0, :-1]
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)
    eng = Engine(out, ctx=512)
    try:
        got = torch.log_softmax(eng.model.forward(Batch.build([(eng.model.new_cache(512), ids.tolist())], "cpu"),
                                                  all_logits=True).float(), -1)
    finally:
        eng.close()
    kl = (ref.exp() * (ref - got)).sum(-1)  # (T,) nats; bench_quality measured mean 8e-4 for int4 g128
    assert kl.mean() < 5e-3 and kl.max() < 0.2, f"int4 default model in ktrun: KL mean {kl.mean():.2e} max {kl.max():.2e}"


def test_training_script_smoke_run_writes_a_loadable_hub_dir(tmp_path):
    """`python -m ktconvert.default_model.train` end to end on 25 stdlib files and 2 steps (about a minute)."""
    import subprocess
    import sys

    from ktconvert.default_model.data import default_stdlib_dir

    if len(list(default_stdlib_dir().glob("*.py"))) < 40:
        pytest.skip(f"no Python standard library source at {default_stdlib_dir()}")
    out = tmp_path / "m"
    r = subprocess.run([sys.executable, "-m", "ktconvert.default_model.train", "--out", str(out), "--steps", "2",
                        "--limit-files", "25"], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (out / "train_state.safetensors").exists()  # optimizer state is removed after a verified export
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in index["weight_map"]
    assert not any("gate_up_proj" in n for n in index["weight_map"])
    stats = json.loads((out / "training_stats.json").read_text())
    assert stats["steps"] == 2 and stats["train_files"] == 24 and stats["heldout_files"] == 1
    assert "completed all 2 steps" in (out / "README.md").read_text(encoding="utf-8")

    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    m = DeepseekV3ForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("import os\n", return_tensors="pt")["input_ids"]
    assert ids[0, 0] == 0 and torch.isfinite(m(input_ids=ids).logits).all()


def test_mtp_training_script_smoke_run_adds_a_loadable_mtp_layer(tmp_path):
    """train_mtp on a copy of a model without an MTP layer: the shard, index, config and card gain the layer;
    transformers still loads the main model with the same logits."""
    from transformers import DeepseekV3ForCausalLM

    base = tmp_path / "base"
    shutil.copytree(MODEL_DIR, base)
    index = json.loads((base / "model.safetensors.index.json").read_text())
    mtp_names = [n for n, f in index["weight_map"].items() if f == "model-mtp.safetensors"]
    if mtp_names:           # the shipped model has its MTP layer: strip it to retrain one
        with safe_open(str(base / "model-mtp.safetensors"), "pt") as f:
            mtp_bytes = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in mtp_names)
        (base / "model-mtp.safetensors").unlink()
        index = {"metadata": {"total_size": index["metadata"]["total_size"] - mtp_bytes},
                 "weight_map": {n: f for n, f in index["weight_map"].items() if f != "model-mtp.safetensors"}}
        (base / "model.safetensors.index.json").write_text(json.dumps(index))
        cfg = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "ktconvert.default_model.train_mtp", "--model", str(base), "--out",
                        str(out), "--steps", "2", "--limit-files", "20", "--eval-tokens", "2048"],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    L = config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    names = {n for n, f in index["weight_map"].items() if f == "model-mtp.safetensors"}
    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
              "self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.15.down_proj.weight", "mlp.gate.weight"):
        assert f"model.layers.{L}.{n}" in names, n
    with safe_open(str(out / "model-mtp.safetensors"), "pt") as f:
        assert set(f.keys()) == names
        nbytes = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in names)
    assert index["metadata"]["total_size"] == json.loads(
        (base / "model.safetensors.index.json").read_text())["metadata"]["total_size"] + nbytes
    stats = json.loads((out / "training_stats.json").read_text())
    assert stats["mtp"]["steps"] == 2 and "## Multi-token prediction (MTP) layer" in (out / "README.md").read_text()
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    a = DeepseekV3ForCausalLM.from_pretrained(str(base)).eval()
    b = DeepseekV3ForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
