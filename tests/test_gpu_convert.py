"""GPU layers through the whole converter: `ktconvert quantize --gpu-method ... --gpu-format ...` on fixtures."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from ktlayouts.converted_dir import MANIFEST_NAME, load_manifest
from ktlayouts.gpu_formats import dequantize_named

from ktconvert.converted_reader import ConvertedDir
from ktconvert.pipeline import TEST_KILL_ENV, ConvertOptions, convert
from ktconvert.sources import open_source

KTCONVERT = [sys.executable, "-c", "from ktconvert.cli import main; main()"]
KINDS = ("attention", "shared_expert", "dense_mlp")


def run_quantize(src, out, *extra, kill_at=None):
    env = {k: v for k, v in os.environ.items() if k != TEST_KILL_ENV}
    if kill_at:
        env[TEST_KILL_ENV] = kill_at
    return subprocess.run([*KTCONVERT, "quantize", str(src), "-o", str(out), "--quiet", *map(str, extra)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def dense_layouts(out) -> dict[str, str]:
    manifest, _ = load_manifest(out)
    return {n: t["layout"] for f in manifest["files"].values() if f["kind"] in ("dense", "globals")
            for n, t in f.get("tensors", {}).items()}


def test_cli_default_is_gptq_and_output_verifies(ckpt_dir, tmp_path):
    src = ckpt_dir("deepseek_v3")
    out = tmp_path / "out"
    res = run_quantize(src, out, "--gpu-group-size", 32)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "gptq-int4" in res.stderr and "calib" in res.stderr          # the log says which method and why
    layouts = dense_layouts(out)
    s = open_source(src)
    quantized = {n for n in s.tensor_names() if s.arch.classify(n).kind in KINDS}
    # the default's measured mixed precision (--gpu-mix-budget): the Linears it upgraded are int8, the rest int4
    upgraded = set(json.loads((out / MANIFEST_NAME).read_text())["gpu_mix"]["upgraded"])
    assert upgraded and upgraded < quantized
    for name in quantized:
        base = name[: -len(".weight")]
        want = "gpu-marlin-int8" if name in upgraded else "gpu-marlin-int4"
        assert layouts[base + ".qweight"] == want and name not in layouts
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        assert layouts[name] in ("dense-bf16", "dense-f32"), name        # full precision, as in the source
    assert json.loads((out / MANIFEST_NAME).read_text())["gpu_method"] == "gptq-int4"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    ver = subprocess.run([*KTCONVERT, "verify", str(out), "--against", str(src)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert ver.returncode == 0, ver.stdout[-3000:] + ver.stderr[-3000:]
    assert "verify: OK" in ver.stdout


@pytest.mark.parametrize("fmt,qm", [("gptq", "gptq"), ("compressed-tensors", "compressed-tensors")])
def test_external_formats_write_their_quantization_config(ckpt_dir, tmp_path, fmt, qm):
    src = ckpt_dir("qwen3_moe")       # hidden 128, head_dim 32: shapes gptq/ct hold without padding
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(gpu_method="rtn-int8", gpu_format=fmt, gpu_group_size=64), show_progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == qm
    conv = ConvertedDir(out)
    layouts = dense_layouts(out)
    s = open_source(src)
    name = "model.layers.0.self_attn.o_proj.weight"
    rel = conv._dense_index[name[: -len("weight")] + ("qweight" if fmt == "gptq" else "weight_packed")]
    f = conv.open(rel)
    parts = {k: f.get_tensor(k).numpy() for k in f.keys() if k.startswith(name[: -len("weight")])}  # noqa: SIM118
    w = dequantize_named(layouts[next(iter(parts))], parts, name)
    ref = s.read(name).numpy()
    assert np.linalg.norm(w - ref) / np.linalg.norm(ref) < 0.02


def test_bad_gpu_options_exit_nonzero_naming_the_flag(ckpt_dir, tmp_path):
    src = ckpt_dir("mixtral")
    res = run_quantize(src, tmp_path / "a", "--gpu-method", "gptq-int4", "--calib", tmp_path / "missing.txt")
    assert res.returncode != 0 and "--calib" in res.stderr and "missing.txt" in res.stderr
    assert not (tmp_path / "a" / MANIFEST_NAME).exists()
    (tmp_path / "empty.txt").write_text("")
    res = run_quantize(src, tmp_path / "b", "--gpu-method", "gptq-int4", "--calib", tmp_path / "empty.txt")
    assert res.returncode != 0 and "is empty" in res.stderr
    res = run_quantize(src, tmp_path / "c", "--gpu-method", "rtn-int4", "--gpu-format", "gptq",
                       "--gpu-group-size", 128)            # K 96: no whole group of 128 (the default is 32)
    assert res.returncode != 0 and "--gpu-format gptq" in res.stderr and "marlin" in res.stderr


def test_killed_gptq_conversion_resumes_byte_identical(ckpt_dir, tmp_path):
    src = ckpt_dir("qwen3_moe")
    args = ("--gpu-method", "gptq-int4", "--gpu-group-size", 32)
    ref = tmp_path / "ref"
    assert run_quantize(src, ref, *args).returncode == 0
    out = tmp_path / "out"
    killed = run_quantize(src, out, *args, kill_at="file:2")            # after the first dense + expert files
    assert killed.returncode != 0 and not (out / MANIFEST_NAME).exists()
    res = run_quantize(src, out, *args, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    files = sorted(p.relative_to(ref) for p in ref.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    for rel in files:
        assert (ref / rel).read_bytes() == (out / rel).read_bytes(), rel
