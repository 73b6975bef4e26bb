"""GPU Linears kept packed in the Marlin layout (ktrun.ops.packed_linear, ktrun.ops.marlin, ktrun.dense_placement).

- The torch unpacking that undoes Marlin's permutations reproduces the golden codes and scales of vLLM's packers.
- A model with packed GPU layers gives the logits of the dequantized-at-load model (CPU, per-call dequantization).
- The kernel adapter hands an installed `apply_gptq_marlin_linear` exactly our bytes, padded input and the right
  type argument, by name; a stand-in provider (computing with ktlayouts' numpy reference) checks that on the CPU.
- On CUDA (skipped visibly elsewhere): packed layers on the device, and the installed Marlin kernel when present.
"""
from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from golden_data import GOLDEN, linear_entries
from ktlayouts.gptq import GptqGeometry, dequantize_kn
from ktlayouts.marlin import marlin_unpack
from ktrun.dense_placement import PlacementError, choose_policy
from ktrun.engine import Engine
from ktrun.models.kv_cache import Batch
from ktrun.ops.marlin import MarlinKernel, find_marlin_kernel
from ktrun.ops.packed_linear import MarlinLinear, marlin_codes, marlin_scales
from runtime_helpers import KTRUN, PROMPT, converted, kl

ENTRIES = linear_entries()
GPU = {"gpu_method": "rtn-int4", "gpu_format": "marlin", "gpu_group_size": 64, "quantize_head": True}
has_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def golden_layer(entry, device="cpu", dtype=torch.float32, kernel=None) -> tuple[MarlinLinear, dict]:
    d = dict(np.load(GOLDEN / entry["file"]))
    layer = MarlinLinear("golden", torch.from_numpy(d["marlin_qweight"]).to(device),
                         torch.from_numpy(d["marlin_scales"]).to(device), entry["bits"], entry["N"], entry["K"],
                         dtype, kernel=kernel)
    return layer, d


def reference_weight(d: dict, entry) -> torch.Tensor:
    """W (N, K) float32 from the golden codes and scales: (code - 2^(bits-1)) * scale of the code's group."""
    g = np.arange(entry["K"]) // (entry["K"] if entry["group_size"] == -1 else entry["group_size"])
    return torch.from_numpy(dequantize_kn(d["codes_kn"], d["scales_fp16"], g, entry["bits"]))


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_torch_unpacking_reproduces_golden_codes_and_scales(entry):
    layer, d = golden_layer(entry)
    assert torch.equal(marlin_codes(layer.qweight, entry["bits"]), torch.from_numpy(d["codes_kn"]))
    grouped = entry["group_size"] not in (-1, entry["K"])
    assert torch.equal(marlin_scales(layer.scales, grouped), torch.from_numpy(d["scales_fp16"]))
    assert torch.equal(layer.dequantize(torch.float32), reference_weight(d, entry))
    assert layer.nbytes == d["marlin_qweight"].nbytes + d["marlin_scales"].nbytes


def engine_logits(conv, gpu_weights: str, device="cpu", **kw) -> tuple[torch.Tensor, Engine]:
    eng = Engine(conv, ctx=256, device=device, use_kernels=False, gpu_weights=gpu_weights, **kw)
    ids = eng.tokenizer.encode(PROMPT)
    out = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], eng.model.device), all_logits=True)
    eng.close()
    return out.float().cpu(), eng


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_packed_gpu_layers_match_dequantized_at_load(tmp_path_factory, arch):
    """Attention (MLA's kv_b absorbed from the packed weight), shared/dense MLPs and the head stay packed; the
    DeepSeek fixture's K and N (e.g. 200) are padded to Marlin's tiles by the converter, so layers pad x, crop y."""
    conv = converted(tmp_path_factory, arch, "int8-amx", **GPU)
    want, eng = engine_logits(conv, "dequant")
    assert eng.converted.gpu_weights == "dequantized at load"
    got, eng = engine_logits(conv, "packed")
    packed = [v for v in eng.converted.dense.values() if isinstance(v, MarlinLinear)]
    assert len(packed) >= 9 and "lm_head.weight" in eng.converted.dense
    assert isinstance(eng.converted.dense["lm_head.weight"], MarlinLinear)
    assert any(p.k_pad != p.k or p.n_pad != p.n for p in packed) == (arch == "deepseek_v3")   # K=200 etc.
    assert eng.converted.gpu_weights == f"{len(packed)} Linears packed, dequantized per call"
    # same float32 weights, only the matmul order differs
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()


def test_placement_policy():
    assert choose_policy("auto", torch.device("cpu"), 1 << 40) == ("dequant", None)
    assert choose_policy("packed", torch.device("cpu"), 0) == ("packed", None)
    assert find_marlin_kernel(torch.device("cpu")) is None
    with pytest.raises(PlacementError, match="--gpu-weights 'fast'"):
        choose_policy("fast", torch.device("cpu"), 0)


def fake_provider(calls: list, type_arg: str = "wtype"):
    """A stand-in for vLLM's marlin_utils: the same names and signature (newer releases name the type argument
    `wtype`, older ones pass `num_bits`); it computes with ktlayouts' numpy reference on the bytes it is given."""
    types = SimpleNamespace(uint4b8="uint4b8", uint8b128="uint8b128")

    def compute(x, weight, weight_scale, weight_zp, g_idx, g_idx_sort_indices, workspace, bits, n, k, is_k_full):
        calls.append({"m": x.shape[0], "k": k, "n": n, "bits": bits, "scale_dtype": weight_scale.dtype,
                      "x_dtype": x.dtype, "is_k_full": is_k_full, "ws": workspace.numel(),
                      "empty": (weight_zp.numel(), g_idx.numel(), g_idx_sort_indices.numel())})
        assert x.shape[1] == k and tuple(weight.shape) == (k // 16, n * 16 * bits // 32)
        groups = weight_scale.shape[0]
        geom = GptqGeometry(n, k, bits, -1 if groups == 1 else k // groups)
        codes, scales = marlin_unpack({"qweight": weight.numpy(), "scales": weight_scale.float().numpy()}, geom)
        w = dequantize_kn(codes, scales, geom.default_g_idx(), bits)
        return (x.float() @ torch.from_numpy(w).t()).to(x.dtype)

    def apply_new(input, weight, weight_scale, weight_zp, g_idx, g_idx_sort_indices, workspace, wtype,
                  output_size_per_partition, input_size_per_partition, is_k_full, input_global_scale=None, bias=None,
                  use_fp32_reduce=True, input_dtype=None):
        bits = {"uint4b8": 4, "uint8b128": 8}[wtype]
        return compute(input, weight, weight_scale, weight_zp, g_idx, g_idx_sort_indices, workspace, bits,
                       output_size_per_partition, input_size_per_partition, is_k_full)

    def apply_old(input, weight, weight_scale, weight_zp, g_idx, g_idx_sort_indices, workspace, num_bits,
                  output_size_per_partition, input_size_per_partition, is_k_full, bias=None):
        return compute(input, weight, weight_scale, weight_zp, g_idx, g_idx_sort_indices, workspace, num_bits,
                       output_size_per_partition, input_size_per_partition, is_k_full)

    return SimpleNamespace(apply_gptq_marlin_linear=apply_new if type_arg == "wtype" else apply_old,
                           scalar_types=types,
                           marlin_make_workspace_new=lambda dev: torch.zeros(132, dtype=torch.int32, device=dev))


@pytest.mark.parametrize("type_arg", ["wtype", "num_bits"])
@pytest.mark.parametrize("entry", [e for e in ENTRIES if e["group_size"] in (64, -1)], ids=lambda e: e["file"])
def test_kernel_adapter_passes_our_layout_by_name(entry, type_arg):
    calls: list = []
    kernel = MarlinKernel("fake", fake_provider(calls, type_arg))
    layer, d = golden_layer(entry, dtype=torch.bfloat16, kernel=kernel)
    x = torch.randn(3, entry["K"], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    b = torch.randn(entry["N"]).to(torch.bfloat16)
    y = layer(x, b)
    (c,) = calls
    assert (c["m"], c["k"], c["n"], c["bits"], c["is_k_full"], c["empty"], c["ws"]) == \
        (3, entry["K"], entry["N"], entry["bits"], True, (0, 0, 0), 132)
    assert c["scale_dtype"] == c["x_dtype"] == torch.bfloat16          # scales in the activation dtype, as vLLM
    want = torch.nn.functional.linear(x.float(), reference_weight(d, entry)) + b.float()
    assert (y.float() - want).abs().max() / want.abs().max() < 2e-2


def test_kernel_adapter_pads_and_crops(tmp_path_factory):
    """A converted model (K, N padded to Marlin tiles) run through the stand-in kernel: same logits."""
    conv = converted(tmp_path_factory, "deepseek_v3", "int8-amx", **GPU)
    want, _ = engine_logits(conv, "dequant")
    import ktrun.dense_placement as dp
    calls: list = []
    orig = dp.find_marlin_kernel
    dp.find_marlin_kernel = lambda device: MarlinKernel("fake", fake_provider(calls))
    try:
        got, eng = engine_logits(conv, "packed", dtype=torch.bfloat16)
    finally:
        dp.find_marlin_kernel = orig
    assert eng.converted.gpu_weights.endswith("Linears packed, Marlin kernel (fake)") and calls
    assert {c["k"] % 128 for c in calls} == {0} and {c["n"] % 64 for c in calls} == {0}
    d = kl(want, got)
    assert d.max() < 5e-2, f"bf16 kernel path vs float32 dequant: KL max {d.max():.2e}"


def test_generate_cli_packed_gives_the_same_tokens(tmp_path_factory):
    conv = converted(tmp_path_factory, "deepseek_v3", "int8-amx", **GPU)
    outs = []
    for mode in ("packed", "dequant"):
        r = subprocess.run([*KTRUN, "generate", str(conv), "--prompt", PROMPT, "--max-tokens", "8", "--ignore-eos",
                            "--json", "--gpu-weights", mode, "--reference-experts"],
                           capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout)["token_ids"])
    assert outs[0] == outs[1]


@pytest.mark.cuda
@has_cuda
def test_cuda_packed_layers_per_call_match_dequant(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KTRUN_MARLIN", "off")
    conv = converted(tmp_path_factory, "deepseek_v3", "int8-amx", **GPU)
    want, _ = engine_logits(conv, "dequant", device="cuda")
    got, eng = engine_logits(conv, "packed", device="cuda")
    assert eng.converted.gpu_weights.endswith("dequantized per call")
    assert kl(want, got).max() < 1e-3


@pytest.mark.cuda
@has_cuda
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_cuda_installed_marlin_kernel_on_golden_layers(entry):
    kernel = find_marlin_kernel(torch.device("cuda"))
    if kernel is None:
        pytest.skip("no Marlin kernel installed (vllm or sglang)")
    layer, d = golden_layer(entry, "cuda", torch.bfloat16, kernel=kernel)
    assert layer.kernel is kernel
    x = torch.randn(5, entry["K"], generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    y = layer(x).float().cpu()
    want = torch.nn.functional.linear(x.float().cpu(), reference_weight(d, entry))
    assert (y - want).abs().max() / want.abs().max() < 2e-2
