"""`ktconvert export --for ENGINE` without kt-kernel: kt-kernel's format (ktlayouts.kt_kernel) round trips, every
size rule of kt-kernel is a clear error before anything is written, `quantize --bf16-scales` makes the scales
bf16 values, and the exports record and print their launch command. kt-kernel itself runs the exports in
tests/test_kt_kernel_interop.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from ktlayouts.kt_kernel import (
    AMX_K_BLOCK,
    KtAlignmentError,
    KtAmxGeometry,
    amx_dequantize,
    check_amx,
    check_gptq,
    check_parts,
    check_rawint4,
    pack_amx,
    quantize_amx,
    unpack_amx,
)
from safetensors import safe_open

from ktconvert.converted_reader import ConvertedDir
from ktconvert.testing import make_checkpoint

KTCONVERT = [sys.executable, "-c", "from ktconvert.cli import main; main()"]
DIMS = {"hidden_size": 256, "moe_intermediate_size": 256}


def run(*args):
    return subprocess.run([*KTCONVERT, *map(str, args)], capture_output=True, text=True, timeout=600, check=False)


def convert(src, out, *args):
    res = run("quantize", src, "-o", out, "--gpu-method", "rtn-int4", "--gpu-group-size", -1, "--quiet", *args)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """qwen3_moe with kt-kernel-sized experts (H = I = 256)."""
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("kt_big"), **DIMS)


# --- ktlayouts.kt_kernel ------------------------------------------------------------------------

@pytest.mark.parametrize(("bits", "n", "k"), [(8, 64, 128), (8, 96, AMX_K_BLOCK + 192), (4, 128, 256),
                                              (4, 160, AMX_K_BLOCK + 256)])
def test_amx_pack_round_trips_and_places_tiles(bits, n, k):
    geom = KtAmxGeometry(n, k, bits)
    rng = np.random.default_rng(bits)
    qmax = 127 if bits == 8 else 7
    q = rng.integers(-qmax, qmax + 1, size=(n, k)).astype(np.int8)
    w = pack_amx(q, geom)
    assert w.shape == (geom.weight_nbytes,) and np.array_equal(unpack_amx(w, geom), q)
    if bits == 8:       # first tile: row r = K-quad r, 16 rows x 4 bytes -> q[c, 4r + j]
        tile = w[:1024].reshape(16, 16, 4).view(np.int8)
        assert np.array_equal(tile, q[:16, :64].reshape(16, 16, 4).transpose(1, 0, 2))
    else:               # int4: low nibbles K 0..63, high nibbles K 64..127
        tile = w[:1024].reshape(16, 16, 4)
        lo = ((tile & 0xF).astype(np.int8) ^ 8) - 8
        hi = ((tile >> 4).astype(np.int8) ^ 8) - 8
        assert np.array_equal(lo, q[:16, :64].reshape(16, 16, 4).transpose(1, 0, 2))
        assert np.array_equal(hi, q[:16, 64:128].reshape(16, 16, 4).transpose(1, 0, 2))


def test_amx_codes_kt_kernel_cannot_take_are_refused():
    for bits, low in ((8, -128), (4, -8)):
        geom = KtAmxGeometry(32, 128, bits)
        q = np.zeros((32, 128), np.int8)
        q[3, 5] = low
        with pytest.raises(ValueError, match=f"overflow at {low}"):
            pack_amx(q, geom)


def test_amx_quantizer_is_kt_kernels():
    """kt-kernel's per-row quantizers: int8 max|w| * (1/127); int4 max|w| / 112 and codes on 16-multiples, / 16."""
    w = np.array([[0.5, -1.0, 0.25, 0.0] * 32, [3.0, 1.5, -0.7, 0.1] * 32], np.float32)
    q8, d8 = quantize_amx(w, 8)
    assert np.array_equal(d8, np.abs(w).max(1) * np.float32(1 / 127)) and q8[0, 1] == -127
    q4, d4 = quantize_amx(w, 4)
    assert np.allclose(d4, np.abs(w).max(1) / 112) and q4.min() >= -7 and q4.max() <= 7 and q4[1, 0] == 7
    assert np.allclose(amx_dequantize(q4, d4, 4)[1, 0], 3.0)


def test_kt_size_rules_say_which_rule_and_why():
    with pytest.raises(KtAlignmentError, match="intermediate size 80 is no multiple of 3 NUMA parts"):
        check_parts(80, 3)
    with pytest.raises(KtAlignmentError, match="96 input columns is no multiple of 128.*two 64-column tiles"):
        check_amx(96, 256, 1, 4)
    with pytest.raises(KtAlignmentError, match="80 output rows is no multiple of 32"):
        check_amx(256, 160, 2, 8)
    with pytest.raises(KtAlignmentError, match="down part I/N = 192/2 = 96 is no multiple of the group length 64"):
        check_gptq(256, 192, 2, 64)
    with pytest.raises(KtAlignmentError, match="runs group 32 only"):
        check_rawint4(256, 256, 1, 64)
    check_amx(7168, 2048, 2, 4), check_gptq(7168, 2048, 2, 128), check_rawint4(7168, 2048, 4, 32)   # DeepSeek-V3


# --- quantize --bf16-scales ---------------------------------------------------------------------

def test_bf16_scales_are_bf16_values_and_stay_accurate(fp8_ckpt, tmp_path):
    """DeepSeek FP8 experts dequantize to values that are not bf16, so their scales are not either, unless rounded.
    (From BF16 sources our scales are bf16 values anyway: the group peak / -2^(b-1) is a bf16 value.)"""
    from ktconvert.sources import open_source
    plain = convert(fp8_ckpt, tmp_path / "plain", "--method", "int4-amx", "--group-size", 32)
    rounded = convert(fp8_ckpt, tmp_path / "bf16", "--method", "int4-amx", "--group-size", 32, "--bf16-scales")
    a, b = ConvertedDir(plain), ConvertedDir(rounded)
    assert b.manifest["expert_scales"] == "bf16" and "expert_scales" not in a.manifest
    for conv, exact in ((a, False), (b, True)):
        f = conv.open("experts/layer-0001.shard-0-of-1.safetensors")
        # as float32 values whatever the stored scale dtype (f16 by default since issue 23, f32 before)
        s = np.concatenate([f.get_tensor(f"{p}.scales").numpy().astype(np.float32).ravel()
                            for p in ("gate", "up", "down")])
        assert bool(np.all((s.view(np.uint32) & 0xFFFF) == 0)) == exact
    with open_source(fp8_ckpt) as src:
        w = src.read("model.layers.1.mlp.experts.3.down_proj.weight").float().numpy()
    err = [np.linalg.norm(c.read_expert(1, 3)["down"] - w) / np.linalg.norm(w) for c in (a, b)]
    assert err[1] < err[0] * 1.05, err                   # rounding the scale first costs (almost) nothing
    a.close(), b.close()
    res = run("quantize", fp8_ckpt, "-o", tmp_path / "bad", "--method", "bf16", "--bf16-scales", "--quiet")
    assert res.returncode != 0 and "--bf16-scales" in res.stderr


# --- refusals: clear errors, exit != 0, nothing written -----------------------------------------

def test_export_for_sglang_kt_refuses_what_kt_kernel_cannot_load(ckpt_dir, fp8_ckpt, big, tmp_path):
    small = convert(ckpt_dir("deepseek_v3"), tmp_path / "small", "--method", "int4-amx", "--group-size", 32,
                    "--gpu-format", "gptq")                   # H = 96, moe I = 160
    ct = convert(big, tmp_path / "ct", "--method", "int4-amx", "--group-size", 32, "--gpu-format",
                 "compressed-tensors")
    int8 = convert(big, tmp_path / "int8", "--method", "int8-amx", "--group-size", -1, "--gpu-format", "gptq")
    fp8 = convert(fp8_ckpt, tmp_path / "fp8", "--method", "int4-amx", "--group-size", 32, "--gpu-format",
                  "compressed-tensors")           # FP8 source: scales are no bf16 values
    cases = [
        ((small, "--for", "sglang-kt", "--kt-method", "AMXINT4"), "96 input columns is no multiple of 128"),
        ((small, "--for", "sglang-kt", "--kt-method", "GPTQ_INT4", "--numa-nodes", 3),
         "intermediate size 160 is no multiple of 3 NUMA parts"),
        ((small, "--for", "sglang-kt", "--kt-method", "GPTQ_INT4", "--numa-nodes", 2),
         "no group length writes these experts.*I/N = 160/2 = 80 is no multiple of the group length 32"),
        ((fp8, "--for", "sglang-kt", "--kt-method", "RAWINT4"), "not bf16 values.*--bf16-scales"),
        ((small, "--for", "sglang-kt", "--kt-method", "RAWINT4"), "--gpu-format compressed-tensors"),
        ((ct, "--for", "sglang-kt", "--kt-method", "GPTQ_INT4"), "--gpu-format gptq"),
        ((int8, "--for", "sglang-kt", "--kt-method", "GPTQ_INT4"), "GPTQ_INT4 holds int4 codes"),
        ((ct, "--for", "sglang-kt"), "needs --kt-method"),
        ((ct, "--kt-method", "AMXINT4"), "need --for sglang-kt"),
        ((ct, "--for", "vllm", "--numa-nodes", 2), "options of --for sglang-kt"),
    ]
    for args, message in cases:
        res = run("export", *args, "-o", tmp_path / "out", "--quiet")
        assert res.returncode != 0, (args, res.stdout)
        assert re.search(message, res.stderr), (args, res.stderr)
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*")), args

    mixtral = convert(ckpt_dir("mixtral"), tmp_path / "mixtral", "--method", "int4-amx", "--group-size", 32,
                      "--bf16-scales", "--gpu-format", "compressed-tensors")
    res = run("export", mixtral, "--for", "sglang-kt", "--kt-method", "RAWINT4", "-o", tmp_path / "out", "--quiet")
    assert res.returncode != 0 and "RAWINT4 loader reads experts named like" in res.stderr


# --- what the targets write ----------------------------------------------------------------------

def test_export_for_sglang_kt_rawint4_is_exact_and_prints_the_launch_command(big, tmp_path):
    conv_dir = convert(big, tmp_path / "conv", "--method", "int4-amx", "--group-size", 32, "--bf16-scales",
                       "--gpu-format", "compressed-tensors")
    out = tmp_path / "kt"
    res = run("export", conv_dir, "--for", "sglang-kt", "--kt-method", "RAWINT4", "--numa-nodes", 2, "-o", out,
              "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    launch = (f"python -m sglang.launch_server --model {out.resolve()} --kt-weight-path {out.resolve()} "
              "--kt-method RAWINT4 --kt-cpuinfer $(nproc) --kt-threadpool-count 2")
    assert launch in res.stdout and "taken over exactly" in res.stdout
    record = json.loads((out / "ktconvert-export.json").read_text())
    assert record["launch"].startswith(launch) and record["kt_weight_path"] == "." and record["expert_group"] == 32
    conv = ConvertedDir(conv_dir)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.experts.5.up_proj"
    with safe_open(str(out / index[f"{name}.weight_scale"]), framework="pt") as h:
        scale = h.get_tensor(f"{name}.weight_scale")
    assert scale.dtype == torch.bfloat16 and scale.shape == (256, 256 // 32)
    f = conv.open("experts/layer-0001.shard-0-of-1.safetensors")
    from ktlayouts.cpu_expert import unpack_scales
    geom = conv.geometry.matrix_geometry("up", 0)
    want = unpack_scales(f.get_tensor("up.scales")[5].numpy(), geom)[:256]
    assert np.array_equal(scale.float().numpy(), want)
    conv.close()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert list(qc["config_groups"].values())[1]["weights"]["group_size"] == 32


def test_export_for_sglang_kt_amx_writes_kt_experts_and_reports_the_error(big, tmp_path):
    conv_dir = convert(big, tmp_path / "conv", "--method", "int8-amx", "--group-size", -1, "--gpu-format",
                       "compressed-tensors")
    out = tmp_path / "kt"
    res = run("export", conv_dir, "--for", "sglang-kt", "--kt-method", "AMXINT8", "--numa-nodes", 2, "-o", out,
              "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"--kt-weight-path {(out / 'kt-experts').resolve()}" in res.stdout and "relative error" in res.stdout
    record = json.loads((out / "ktconvert-export.json").read_text())
    err = record["expert_error"]
    assert 0 < max(err["rel_error"].values()) < 0.005 and err["rows_requantized"] == 0
    files = sorted(p.name for p in (out / "kt-experts").iterdir())
    assert files == ["layer-0000.safetensors", "layer-0001.safetensors"]
    with safe_open(str(out / "kt-experts" / files[1]), framework="np") as h:
        names = set(h.keys())
        assert "blk.1.ffn_down_exps.7.numa.1.weight" in names and "blk.1.ffn_gate_exps.0.numa.0.scale" in names
        q = unpack_amx(h.get_tensor("blk.1.ffn_up_exps.2.numa.1.weight"), KtAmxGeometry(128, 256, 8))
        up = amx_dequantize(q, h.get_tensor("blk.1.ffn_up_exps.2.numa.1.scale"), 8)
    conv = ConvertedDir(conv_dir)
    ref = conv.read_expert(1, 2)["up"][128:]
    assert np.linalg.norm(up - ref) / np.linalg.norm(ref) < 0.005
    # on the conversion's own grid: every code but the row peak (-128 -> -127) is exact
    assert np.mean(up == ref) > 0.99
    conv.close()


@pytest.mark.parametrize("target", ["vllm", "transformers"])
def test_export_for_vllm_and_transformers_is_the_hub_checkpoint(ckpt_dir, tmp_path, target):
    conv_dir = convert(ckpt_dir("deepseek_v3"), tmp_path / "conv", "--method", "int4-amx", "--group-size", 128,
                       "--gpu-format", "compressed-tensors")
    plain, out = tmp_path / "plain", tmp_path / target
    assert run("export", conv_dir, "-o", plain, "--quiet").returncode == 0
    res = run("export", conv_dir, "--for", target, "-o", out, "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    for f in plain.iterdir():                              # the same checkpoint, byte for byte
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    record = json.loads((out / "ktconvert-export.json").read_text())
    assert record["target"] == target and record["launch"] in res.stdout
    assert (f"vllm serve {out.resolve()}" if target == "vllm" else "AutoModelForCausalLM.from_pretrained") \
        in record["launch"]


def test_gpt_oss_export_is_the_fused_hub_layout_and_refused_for_kt_kernel(ckpt_dir, tmp_path):
    """gpt-oss's experts (biases, clamped SwiGLU) are something kt-kernel cannot compute: --for sglang-kt is refused
    naming the rule; its hub layout holds the experts fused, which no GPU Linear format quantizes: the plain export
    asks for --experts bf16, and --for vllm writes that checkpoint (transformers loads it: tests/test_export_hf.py)."""
    conv_dir = convert(ckpt_dir("gpt_oss"), tmp_path / "conv", "--method", "int8-amx", "--group-size", 32,
                       "--expert-quantizer", "rtn", "--gpu-format", "compressed-tensors")
    kt_rule = (r"kt-kernel's CPU MoE .* computes silu\(gate\) \* up without biases.*gpt_oss's routed experts use "
               r"the swiglu_clamped activation with per-expert biases")
    for args, message in [(("--for", "sglang-kt", "--kt-method", "AMXINT8"), kt_rule),
                          ((), r"experts fused per layer .*--experts bf16")]:
        res = run("export", conv_dir, *args, "-o", tmp_path / "out", "--quiet")
        assert res.returncode != 0 and re.search(message, res.stderr), (args, res.stderr)
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*")), args
    plain, out = tmp_path / "plain", tmp_path / "vllm"
    assert run("export", conv_dir, "--experts", "bf16", "-o", plain, "--quiet").returncode == 0
    res = run("export", conv_dir, "--for", "vllm", "-o", out, "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    for f in plain.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
            "model.layers.1.mlp.experts.gate_up_proj_bias"} <= set(index)
    assert not [n for n in index if re.search(r"experts\.\d+\.", n)]
    assert "bf16" in json.loads((out / "ktconvert-export.json").read_text())["experts"]
