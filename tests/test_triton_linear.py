"""ktrun's Triton W4A16 / W8A16 kernel on the GPTQ layout (ktrun.ops.triton_linear) and its placement
(ktrun.dense_placement, --gpu-weights packed).

- Without a GPU: the kernel runs on CPU tensors under Triton's interpreter. Triton reads TRITON_INTERPRET when it is
  imported, so those checks run in a subprocess (tests/triton_interpret_cases.py) whose JSON lines are asserted here:
  every golden layer of vLLM's packers (GPTQ bytes read in place, Marlin bytes repacked), act-order g_idx, padded
  shapes of every registered GPU format, 1 / 7 / 33 rows, bf16 / fp16 / fp32 inputs, split-K forced and chosen, all
  against a float64 reference computed from the codes and scales; and whole models (packed on Triton vs dequantized
  at load, float32 and bf16), hot experts held as gptq slots, and `ktrun generate` giving the same tokens.
- In process: the torch repack of Marlin bytes reproduces the golden GPTQ bytes; the launch configuration keeps a K
  block inside one group; the KTRUN_TRITON policy.
- On CUDA (`-m cuda`, bench/device_check.sh): the compiled kernel on the golden layers and act order, and a model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from golden_data import GOLDEN, linear_entries
from ktlayouts.gptq import GptqGeometry, pack_rows
from ktrun.ops.packed_linear import MarlinLinear
from ktrun.ops.triton_linear import (
    DECODE_ROWS,
    TritonLinear,
    launch_config,
    pack_rows_torch,
    triton_missing,
    use_triton,
)
from runtime_helpers import KTRUN, PROMPT, converted

TESTS = Path(__file__).resolve().parent
ENTRIES = linear_entries()
MARLIN = {"gpu_method": "rtn-int4", "gpu_format": "marlin", "gpu_group_size": 64, "quantize_head": True}
GPTQ_ACT = {"gpu_method": "gptq-int4", "gpu_format": "gptq", "gpu_group_size": 32, "gpu_act_order": True}
# the interpreter's dots take float32 operands: products of bf16/fp16 inputs and codes are exact, only sums round
KERNEL_REL_ERR = 1e-5
has_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(triton_missing() is not None, reason=str(triton_missing()))


def interpreted(*args: str, timeout: int = 600) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "KTRUN_TRITON": "on",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(TESTS / "triton_interpret_cases.py"), *args], env=env,
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def kernel_cases() -> dict[str, dict]:
    return {c["case"]: c for c in interpreted("kernels")}


def _group(cases: dict, prefix: str) -> dict:
    return {k: c for k, c in cases.items() if k.startswith(prefix)}


@needs_triton
@pytest.mark.parametrize("prefix, count", [("golden-gptq-", 8 * 5), ("golden-marlin-", 8 * 5),
                                           ("act-order-", 6 * 5), ("padded-", 3 * 2 * 3 * 5)])
def test_interpreted_kernel_matches_the_reference(kernel_cases, prefix, count):
    cases = _group(kernel_cases, prefix)
    assert len(cases) == count, sorted(cases)[:5]
    bad = {k: c["rel_err"] for k, c in cases.items() if not c["finite"] or c["rel_err"] > KERNEL_REL_ERR}
    assert not bad, bad


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_marlin_repack_gives_the_golden_gptq_bytes(entry):
    """Marlin bytes of vLLM's packer, repacked by torch at load, are byte for byte vLLM's GPTQ packing."""
    d = dict(np.load(GOLDEN / entry["file"]))
    assert np.array_equal(pack_rows_torch(torch.from_numpy(d["codes_kn"]), entry["bits"]).numpy(), d["gptq_qweight"])
    assert np.array_equal(pack_rows(d["codes_kn"], entry["bits"]), d["gptq_qweight"])
    marlin = MarlinLinear("golden", torch.from_numpy(d["marlin_qweight"]), torch.from_numpy(d["marlin_scales"]),
                          entry["bits"], entry["N"], entry["K"], torch.bfloat16)
    layer = TritonLinear.from_marlin(marlin)
    assert np.array_equal(layer.qweight.numpy(), d["gptq_qweight"])
    assert np.array_equal(layer.scales.numpy(), d["scales_fp16"]) and layer.g_idx is None
    g = np.arange(entry["K"]) // layer.group
    want = (d["codes_kn"].astype(np.float32) - (1 << (entry["bits"] - 1))) * d["scales_fp16"].astype(np.float32)[g]
    assert torch.equal(layer.dequantize(torch.float32), torch.from_numpy(want.T))
    assert layer.nbytes == d["gptq_qweight"].nbytes + d["scales_fp16"].nbytes


@pytest.mark.parametrize("m", [1, 4, DECODE_ROWS, 17, 512])
@pytest.mark.parametrize("group, act", [(32, False), (64, False), (128, False), (7168, False), (128, True)])
def test_launch_config_keeps_a_k_block_in_one_group(m, group, act):
    cfg = launch_config(m, 2048, 7168, group, act, torch.device("cpu"))
    assert act or group % cfg.block_k == 0
    assert cfg.block_k >= 16 and cfg.block_m >= 16 and cfg.block_m >= min(m, 64)    # tl.dot's smallest tiles
    assert 1 <= cfg.split_k <= -(-7168 // cfg.block_k)
    assert launch_config(m, 2048, 7168, group, act, torch.device("cpu"), split_k=10**6).split_k == \
        -(-7168 // cfg.block_k)


def test_policy(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("KTRUN_TRITON", raising=False)
    assert not use_triton(cpu, marlin_found=False)           # the interpreter is off in this process
    if triton_missing() is None:
        assert use_triton(cuda, marlin_found=False) and not use_triton(cuda, marlin_found=True)
        monkeypatch.setenv("KTRUN_TRITON", "on")
        assert use_triton(cuda, marlin_found=True)
    monkeypatch.setenv("KTRUN_TRITON", "off")
    assert not use_triton(cuda, marlin_found=False)
    monkeypatch.setenv("KTRUN_TRITON", "fast")
    with pytest.raises(ValueError, match="KTRUN_TRITON='fast'"):
        use_triton(cuda, marlin_found=False)


@needs_triton
def test_models_on_the_interpreted_kernel_match_dequantized_at_load(tmp_path_factory):
    """A DeepSeek-V3 fixture (Marlin layers, K and N padded, MLA's kv_b absorbed from the packed weight) and a
    Qwen3-MoE fixture (GPTQ with act order: permuted g_idx) through the whole model."""
    convs = [converted(tmp_path_factory, "deepseek_v3", "int8-amx", **MARLIN),
             converted(tmp_path_factory, "qwen3_moe", "int8-amx", **GPTQ_ACT)]
    rows = interpreted("engine", *map(str, convs))
    assert len(rows) == 4
    for r in rows:
        assert "Linears packed, Triton kernel" in r["how"], r
        if r["case"].endswith("float32"):              # same float32 weights, only the sums' order differs
            assert r["max_abs"] < 1e-4 and r["same_argmax"], r
        else:       # bf16: the dequantized model rounds its weights to bf16, the kernel keeps codes and scales exact.
            # torch's bf16 GEMMs differ by CPU: the DeepSeek-V3 fixture's KL max 1.4e-2 on Zen 4 (AVX512-BF16), the
            # same before and after 2026-12-07's changes (1.45e-2 at 501fffa); below 1e-2 on the Zen 3 / AMX runs
            assert r["kl_max"] < 2e-2, r
    assert "act-order" in rows[-1]["how"]


@needs_triton
def test_hot_experts_held_as_gptq_run_on_the_interpreted_kernel(tmp_path_factory):
    """Hot experts in gptq slots (TritonLinear, filled in place) against the torch reference experts: the same codes
    and scales on both sides, so equal up to summation order; 'auto' picks gptq where the kernel runs. DeepSeek-V3
    and gpt-oss (expert biases, the clamped SwiGLU)."""
    convs = [converted(tmp_path_factory, "deepseek_v3", "int4-amx"),
             converted(tmp_path_factory, "gpt_oss", "int4-amx", group_size=32)]
    rows = interpreted("hot", *map(str, convs))
    assert len(rows) == 4
    for r in rows:
        assert r["format"] == "gptq" and r["triton_slots"] and r["slots"] > 0 and r["hit_ratio"] > 0, r
        assert r["max_abs"] < 1e-4, r


@needs_triton
def test_generate_cli_on_the_interpreted_kernel_gives_the_same_tokens(tmp_path_factory):
    conv = converted(tmp_path_factory, "deepseek_v3", "int8-amx", **MARLIN)
    outs = {}
    for mode, env in (("packed", {"TRITON_INTERPRET": "1", "KTRUN_TRITON": "on"}), ("dequant", {})):
        r = subprocess.run([*KTRUN, "generate", str(conv), "--prompt", PROMPT, "--max-tokens", "8", "--ignore-eos",
                            "--json", "--gpu-weights", mode, "--reference-experts", "--device", "cpu"],
                           capture_output=True, text=True, timeout=300, check=False, env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
        outs[mode] = json.loads(r.stdout)["token_ids"]
    assert outs["packed"] == outs["dequant"]


# --- on a GPU (bench/device_check.sh runs these) -----------------------------------------------------------------

@pytest.mark.cuda
@has_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_cuda_kernel_on_golden_layers(entry, m):
    d = dict(np.load(GOLDEN / entry["file"]))
    g = np.arange(entry["K"]) // (entry["K"] if entry["group_size"] == -1 else entry["group_size"])
    w = (d["codes_kn"].astype(np.float64) - (1 << (entry["bits"] - 1))) * d["scales_fp16"].astype(np.float64)[g]
    layer = TritonLinear("golden", torch.from_numpy(d["gptq_qweight"]).cuda(),
                         torch.from_numpy(d["scales_fp16"]).cuda(), None, entry["bits"], entry["group_size"],
                         entry["N"], entry["K"], torch.bfloat16)
    x = torch.randn(m, entry["K"], generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    want = x.double() @ torch.from_numpy(w)
    got = layer(x.cuda()).double().cpu()
    # exact products, float32 sums, the output rounded to bf16 (2^-9 relative)
    assert (got - want).abs().max() / want.abs().max() < 8e-3


@pytest.mark.cuda
@has_cuda
@needs_triton
def test_cuda_act_order_layer():
    rng = np.random.default_rng(1)
    geom = GptqGeometry(256, 512, 4, 64)
    codes = rng.integers(0, 16, (512, 256), dtype=np.uint8)
    scales = (rng.random(geom.scales_shape) * 0.02 + 1e-3).astype(np.float16)
    g_idx = rng.permutation(geom.default_g_idx()).astype(np.int32)
    layer = TritonLinear("act", torch.from_numpy(pack_rows(codes, 4)).cuda(), torch.from_numpy(scales).cuda(),
                         torch.from_numpy(g_idx).cuda(), 4, 64, 256, 512, torch.bfloat16)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w = (codes.astype(np.float64) - 8) * scales.astype(np.float64)[g_idx]
    want = x.double() @ torch.from_numpy(w)
    got = layer(x.cuda()).double().cpu()
    assert (got - want).abs().max() / want.abs().max() < 2e-2     # weights rounded to bf16 before the dot


@pytest.mark.cuda
@has_cuda
@needs_triton
def test_cuda_model_on_triton_matches_the_cpu_run(tmp_path_factory, monkeypatch):
    """Greedy tokens of the DeepSeek-V3 fixture with its GPU layers on the Triton kernel equal the CPU-only run's."""
    monkeypatch.setenv("KTRUN_TRITON", "on")
    conv = converted(tmp_path_factory, "deepseek_v3", "int8-amx", **MARLIN)
    outs = {}
    for device, mode in (("cuda", "packed"), ("cpu", "dequant")):
        r = subprocess.run([*KTRUN, "generate", str(conv), "--prompt", PROMPT, "--max-tokens", "8", "--ignore-eos",
                            "--json", "--gpu-weights", mode, "--reference-experts", "--device", device],
                           capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr
        outs[device] = json.loads(r.stdout)["token_ids"]
    assert outs["cuda"] == outs["cpu"]
