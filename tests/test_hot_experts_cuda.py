"""Hot experts on a real GPU (skipped, visibly, without CUDA; bench/device_check.sh runs them on a CUDA machine):
the store's experts on the device equal the CPU stand-in's, a model with dense layers and hot experts on the GPU stays
within the bound of its all-CPU-experts run (also gpt-oss, with expert biases and the clamped SwiGLU), dynamic swaps
(copies on a side stream, flipped between steps) change no output against their synchronous replay, and an installed
Marlin GEMM computes Marlin hot experts; gptq hot experts run on ktrun's Triton kernel."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ktrun.experts.hot_store import HotExpertStore
from ktrun.experts.placement import Budget, HotExpertOptions
from ktrun.loaded_model import load_model
from ktrun.models.kv_cache import Batch
from ktrun.ops.marlin import find_marlin_kernel
from runtime_helpers import converted
from test_hot_experts_runtime import PROMPTS, run_batch

from ktconvert.pipeline import ConvertOptions, convert

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (hot experts on the GPU)")]

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "ktconvert" / "data" / "default_model"
TEXT = (DEFAULT_MODEL / "heldout_eval.txt").read_text()[5000:9000]


@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hotcuda") / "dm-int4"
    convert(DEFAULT_MODEL, out, ConvertOptions(method="int4-amx", gpu_method="bf16"), show_progress=False)
    return out


@pytest.fixture(scope="module")
def oss(tmp_path_factory) -> Path:
    """gpt-oss's fixture, int4 g32 experts with biases and the clamped SwiGLU."""
    return converted(tmp_path_factory, "gpt_oss", "int4-amx", group_size=32)


MODELS = ["conv", "oss"]        # the default model (DeepSeek-V3 architecture) and gpt-oss


def forced(lm, ids) -> torch.Tensor:
    return lm.model.forward(Batch.build([(lm.model.new_cache(len(ids) + 1), ids)], lm.model.device),
                            all_logits=True).float().cpu()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fmt", ["bf16", "marlin", "gptq"])
def test_cuda_store_equals_the_cpu_stand_in(request, model, fmt):
    """The device store computes what the CPU stand-in does (gpt-oss: with the experts' biases and clamped SwiGLU)."""
    with load_model(request.getfixturevalue(model), device="cpu") as lm:
        c = lm.converted
        geo, k = c.geometry, lm.model.cfg.top_k
        layer, hot = geo.moe_layers[1], (1, 7, geo.n_experts - 4)
        # gptq (ktrun's Triton kernel) against the Marlin stand-in: the same codes and scales, dequantized per call
        cpu = HotExpertStore(c, {layer: 3}, "marlin" if fmt == "gptq" else fmt, device="cpu", dtype=torch.float32)
        gpu = HotExpertStore(c, {layer: 3}, fmt, device="cuda", dtype=torch.bfloat16)
        for slot, e in enumerate(hot):
            cpu.load(layer, slot, e)
            gpu.load(layer, slot, e)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(9, geo.hidden, generator=g)
        ids = torch.stack([torch.randperm(geo.n_experts, generator=g)[:k] for _ in range(9)]).numpy()
        w = torch.rand(9, k, generator=g)
        slot_of = np.full(geo.n_experts, -1, np.int32)
        slot_of[list(hot)] = [0, 1, 2]
        hit = slot_of[ids] >= 0
        assert hit.any()
        want = cpu.compute(layer, x, ids, w, hit, slot_of)
        got = gpu.compute(layer, x.cuda().bfloat16(), ids, w.cuda(), hit, slot_of)
        assert got.device.type == "cuda"
        assert (got.cpu() - want).abs().max() / want.abs().max() < 3e-2


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fmt", ["bf16", "marlin", "gptq"])
def test_cuda_hybrid_model_within_the_bound(request, model, fmt):
    """Dense layers and hot experts on the GPU (bf16) against the same with every expert on the CPU kernels (half
    of each layer's experts hot)."""
    conv = request.getfixturevalue(model)
    with load_model(conv, device="cuda") as lm:
        ids = lm.tokenizer.encode(TEXT)[:160]
        base = forced(lm, ids)
    with load_model(conv, device="cuda", use_kernels=False) as lm:
        exact = forced(lm, ids)
        per_layer = lm.converted.geometry.n_experts // 2
    opts = HotExpertOptions(budget=Budget(per_layer=per_layer), strategy="uniform", gpu_format=fmt)
    with load_model(conv, device="cuda", hot_experts=opts) as lm:
        ex = lm.model.experts
        assert ex.store.device.type == "cuda" and ex.store.format == fmt
        got = forced(lm, ids)
        assert ex.stats["gpu_hit_ratio"] > 0.3
    # bf16 activations on the GPU side instead of the kernels' int8: about the kernels' own error, twice at most
    assert (got - base).abs().mean() <= 2.0 * (exact - base).abs().mean() + 1e-3


def test_cuda_dynamic_swaps_change_no_output(conv):
    """Copies on a side stream, each waiting for the last reader of its slot, flipped between steps: the batch's
    outputs equal a synchronous replay of the same placements, bit for bit."""
    opts = HotExpertOptions(budget=Budget(per_layer=3), strategy="uniform", dynamic=True, window=24,
                            hysteresis=0.0, min_gap=0.0)
    toks, logits, ex, _ = run_batch(conv, opts, device="cuda")
    assert ex.store.device.type == "cuda" and ex.dynamic._stream is not None and ex.dynamic.swaps >= 3
    toks2, logits2, _, _ = run_batch(conv, opts, replay_log=ex.dynamic.log, device="cuda")
    assert toks2 == toks and len(toks) == len(PROMPTS)
    assert all(torch.equal(a, b) for a, b in zip(logits, logits2))


def test_cuda_marlin_kernel_runs_marlin_hot_experts(conv):
    if find_marlin_kernel(torch.device("cuda")) is None:
        pytest.skip("no Marlin kernel installed (vllm or sglang)")
    opts = HotExpertOptions(budget=Budget(per_layer=4), strategy="uniform", gpu_format="auto")
    with load_model(conv, device="cuda", hot_experts=opts) as lm:
        ex = lm.model.experts
        assert ex.store.format == "marlin" and all(lin.kernel is not None for lin in ex.store.slots[1][0])
        e = ex.residency.on_gpu(1)[0]
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
        got = ex.store.expert_forward(1, int(ex.residency.slot[1][e]), x.cuda().bfloat16()).float().cpu()
        cpu = HotExpertStore(lm.converted, {1: 1}, "marlin", device="cpu", dtype=torch.float32)
        cpu.load(1, 0, e)
        want = cpu.expert_forward(1, 0, x)
    assert (got - want).abs().max() / want.abs().max() < 3e-2
