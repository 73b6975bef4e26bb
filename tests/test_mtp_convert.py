"""`ktconvert quantize --keep-mtp` (the default): the checkpoint's multi-token-prediction (MTP) layer is written like
any layer, listed in the manifest as MTP, shown by `inspect`; `--no-keep-mtp` drops it; ktrun loads a conversion with
MTP layers and ignores them unless asked to draft with them.

Every fixture family whose hub checkpoints carry an MTP layer (DeepSeek's layout at layer L = num_hidden_layers:
enorm, hnorm, eh_proj, shared_head.norm / head, embed_tokens and a MoE decoder layer) is converted through the real
CLI: int4 routed experts as CPU expert files, rtn-int4 GPU layers; each MTP tensor reads back as the source's within
the layout's error (bf16 tensors exactly).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ktlayouts.converted_dir import MTP_DENSE_KIND, MTP_EXPERT_KIND, dense_file, expert_file, load_manifest
from ktrun.generate import prefill
from ktrun.loaded_model import load_model
from runtime_helpers import PROMPT, build_checkpoint, build_conversion, shared_root
from safetensors import safe_open

from ktconvert.converted_reader import ConvertedDir, relative_error
from ktconvert.testing import FIXTURES

MTP_ARCHS = [a for a, f in FIXTURES.items() if f.mtp]
KTCONVERT = [sys.executable, "-m", "ktconvert"]


def quantize(src: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([*KTCONVERT, "quantize", str(src), "-o", str(out), "--quiet", "--gpu-method", "rtn-int4",
                        *args], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def source_tensors(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return out


def test_mtp_fixture_families():
    assert {"deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa"} <= set(MTP_ARCHS)


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_quantize_keeps_the_mtp_layer(arch, tmp_path_factory, tmp_path):
    src = build_checkpoint(shared_root(tmp_path_factory), arch)
    L = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    r = quantize(src, tmp_path / "out")
    assert f"multi-token-prediction layer(s) [{L}] kept" in r.stderr and "skipped" not in r.stderr
    out = tmp_path / "out"
    m, geo = load_manifest(out)
    assert m["mtp_layers"] == [L] and m["num_layers"] == L and L not in geo.moe_layers
    kinds = {rel: f["kind"] for rel, f in m["files"].items() if f.get("layer") == L}
    assert kinds == {dense_file(L): MTP_DENSE_KIND, expert_file(L, 0, 1): MTP_EXPERT_KIND}
    # every MTP tensor of the source is there: routed experts in the expert file, the rest in the dense file
    tensors = source_tensors(src)
    prefix = f"model.layers.{L}."
    conv = ConvertedDir(out, mtp=True)
    dense = set(conv.dense_names())
    mine = {n for n in tensors if n.startswith(prefix) and ".mlp.experts." not in n}
    assert mine == {n for n in dense if n.startswith(prefix)}
    for extra in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"):
        assert f"{prefix}{extra}.weight" in mine
    assert conv.dense_layout(prefix + "eh_proj.weight") != "dense-bf16"           # a GPU layer, quantized
    for name in sorted(mine):
        got, want = conv.read_dense(name), tensors[name].float().numpy()
        if conv.dense_layout(name) in ("dense-bf16", "dense-f32"):
            assert np.array_equal(got, want), name
        else:
            assert relative_error(got, want) < 0.15, name
    for e in range(geo.n_experts):
        got = conv.read_expert(L, e)
        for proj, hub in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            want = tensors[f"{prefix}mlp.experts.{e}.{hub}.weight"].float().numpy()
            assert relative_error(got[proj][:want.shape[0], :want.shape[1]], want) < 0.15, (e, proj)
    # the main model's files are what --no-keep-mtp writes, byte for byte
    quantize(src, tmp_path / "no_mtp", "--no-keep-mtp")
    m2, _ = load_manifest(tmp_path / "no_mtp")
    assert "mtp_layers" not in m2 and all(f["kind"] not in (MTP_DENSE_KIND, MTP_EXPERT_KIND)
                                          for f in m2["files"].values())
    main = {rel: f["sha256"] for rel, f in m["files"].items() if f["kind"] not in (MTP_DENSE_KIND, MTP_EXPERT_KIND)}
    assert main == {rel: f["sha256"] for rel, f in m2["files"].items()}


def test_no_keep_mtp_skips_it_and_inspect_shows_the_mtp_bytes(tmp_path_factory, tmp_path):
    src = build_checkpoint(shared_root(tmp_path_factory), "deepseek_v3")
    n_mtp = sum(n.startswith("model.layers.3.") for n in source_tensors(src))
    r = quantize(src, tmp_path / "no_mtp", "--no-keep-mtp")
    assert f"skipped {n_mtp} tensors: multi-token-prediction layer" in r.stderr
    quantize(src, tmp_path / "out")
    m, _ = load_manifest(tmp_path / "out")
    gpu = sum(f["size"] for f in m["files"].values() if f["kind"] == MTP_DENSE_KIND)
    cpu = sum(f["size"] for f in m["files"].values() if f["kind"] == MTP_EXPERT_KIND)

    def inspect(path: Path) -> str:
        r = subprocess.run([*KTCONVERT, "inspect", str(path)], capture_output=True, text=True, timeout=120,
                           check=False)
        assert r.returncode == 0, r.stderr
        return r.stdout
    from ktrun.byte_sizes import human
    text = inspect(tmp_path / "out")
    assert "MTP layer(s) [3] (written, loaded by ktrun --speculative mtp only):" in text, text
    assert re.search(rf"int4-amx\s+GPU\s+{re.escape(human(gpu))}\s+CPU\s+{re.escape(human(cpu))}", text), text
    assert "MTP layer" not in inspect(tmp_path / "no_mtp")
    text = inspect(src)
    assert re.search(r"MTP layer\(s\) \[3\] \(written unless --no-keep-mtp, loaded by ktrun --speculative mtp only\): "
                     r"[\d,]+ parameters:", text), text
    assert "not converted" not in text


def test_ktrun_ignores_the_mtp_layer_unless_asked(tmp_path_factory, tmp_path):
    """A conversion with an MTP layer runs as the same conversion without it: the same logits, bit for bit, and
    none of the MTP layer's tensors loaded."""
    src = build_checkpoint(shared_root(tmp_path_factory), "deepseek_v3")
    with_mtp = build_conversion(src, tmp_path / "with", "int4-amx", gpu_method="rtn-int4")
    without = build_conversion(src, tmp_path / "without", "int4-amx", gpu_method="rtn-int4", keep_mtp=False)
    logits = []
    for conv in (with_mtp, without):
        with load_model(conv) as lm:
            assert not any(n.startswith("model.layers.3.") for n in lm.model.w)
            ids = lm.tokenizer.encode(PROMPT)
            logits.append(prefill(lm.model, lm.model.new_cache(64), ids))
    assert torch.equal(*logits)


def test_mtp_copies_of_the_embedding_and_head_are_not_written_again(tmp_path_factory, tmp_path):
    """DeepSeek-V3's release repeats the embedding and lm_head in its MTP layer (2 x 1.85 GB): equal copies are
    compared once and left out, the rest of the MTP layer is written."""
    from safetensors.torch import save_file
    src = build_checkpoint(shared_root(tmp_path_factory), "deepseek_v3")
    t = source_tensors(src)
    copy = {**t, "model.layers.3.embed_tokens.weight": t["model.embed_tokens.weight"].clone(),
            "model.layers.3.shared_head.head.weight": t["lm_head.weight"].clone()}
    (tmp_path / "src").mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            (tmp_path / "src" / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in copy.items()}, tmp_path / "src" / "model.safetensors",
              metadata={"format": "pt"})
    r = quantize(tmp_path / "src", tmp_path / "out")
    assert "model.layers.3.embed_tokens.weight, model.layers.3.shared_head.head.weight equal the main model's and " \
           "are not written again" in r.stderr, r.stderr
    dense = set(ConvertedDir(tmp_path / "out", mtp=True).dense_names())
    assert "model.layers.3.eh_proj.weight" in dense and "model.layers.3.enorm.weight" in dense
    assert not {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"} & dense
