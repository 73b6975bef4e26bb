"""Every family converted with quantized experts and quantized GPU layers (int8 experts + rtn-int8 Linears; int4
experts + rtn-int4 Linears) runs in ktrun as transformers runs the same quantized model: logits of the prompt within
a stated bound and each token of a 32-token greedy continuation transformers' argmax at the same prefix up to a
stated logit gap.

"The same quantized model" is the hub checkpoint with every converted tensor replaced by its value in the converted
files, as ktconvert.converted_reader reads them (ktlayouts' reference unpack, itself checked against
tests/golden bytes and gguf-py / compressed-tensors elsewhere); transformers then runs its own class on it. So the
comparison isolates ktrun's forward on quantized weights (MLA, the V3.2 indexer, partial rotary, q/k norms,
routing, the int4/int8 expert executors) from the quantization error itself, which tests/test_runtime_quantized.py
bounds separately (KL against the bf16 conversion, = transformers' bf16 forward within 1e-4 by
tests/test_runtime_models.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from discrete_choices import compare, force_transformers, prompt_and_greedy_with_choices
from ktrun.engine import Engine
from ktrun.ops.library import kernels_available
from runtime_helpers import (
    PROMPT,
    build_checkpoint,
    converted,
    greedy_gaps,
    reference_logits,
    shared_root,
    transformers_model,
)

from ktconvert.converted_reader import ConvertedDir
from ktconvert.sources import open_source
from ktconvert.testing import ARCHS

# (expert --method, --gpu-method)
SCHEMES = [("int8-amx", "rtn-int8"), ("int4-amx", "rtn-int4")]
# Reference executor: float32 on both sides from identical dequantized weights, as the bf16 conversions. Kernels:
# int8 activations (int4/int8 experts) and bf16-rounded activations add their own rounding, which may flip a
# discrete choice at a near-tie (a router's experts, DeepSeek-V3.2's indexer keys) and change that position
# outright; so transformers runs with ktrun's choices (discrete_choices.py) and every place where its own choice
# differs must be a near-tie its scores' measured difference explains, the scores within SCORE_BOUND of the row's
# top score.
LOGIT_ATOL = {"reference": 1e-4, "kernels": 5e-2}
GREEDY_GAP = {"reference": 1e-3, "kernels": 1e-1}
SCORE_BOUND = {"reference": dict.fromkeys(("router", "router_group", "indexer"), 1e-4),
               "kernels": {"router": 1e-2, "router_group": 1e-2, "indexer": 5e-2}}
# Observed (2 threads, avx512), every family and scheme. Reference: max |logit diff| <= 3.8e-6, every greedy token
# transformers' argmax, choice scores <= 2.1e-6 of the row's top score, no flip. Kernels: max |logit diff| <= 2.9e-2,
# greedy gaps <= 5.5e-3, router scores <= 1.5e-3, indexer scores <= 1.2e-2, flips at DeepSeek-V3.2 (indexer keys,
# margin 1.2e-3..4.3e-3; an expert and a group) and MiniMax-M2 (an expert, margin 5e-6).
BACKENDS = ["reference", pytest.param("kernels", marks=pytest.mark.skipif(
    not kernels_available(), reason="libktkernels / runtime/ops/moe.py not available on this machine"))]


def _fused(tensors: dict, arch) -> dict:
    """gpt-oss: per-expert (N, K) weights back into the hub's fused layout, gate_up (E, H, 2I) with gate and up
    interleaved and down (E, I, H), the layout transformers loads."""
    out = {n: t for n, t in tensors.items() if arch.classify(n).kind != "expert"}
    for layer in arch.moe_layers():
        w = {p: torch.stack([tensors[arch.expert_tensor_name(layer, e, p)] for e in range(arch.n_experts)])
             for p in ("gate", "up", "down")}
        gate_up = torch.stack([w["gate"], w["up"]], dim=-2).flatten(1, 2)          # (E, 2I, H): rows g0 u0 g1 ...
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = w["down"].transpose(1, 2).contiguous()
    return out


def quantized_reference_checkpoint(src: Path, conv: Path, out: Path) -> Path:
    """src's hub checkpoint with each tensor the conversion holds replaced by its dequantized value (float32);
    tensors the conversion skips (MTP layers, Kimi-K2.5's vision tower) stay as they are."""
    from safetensors.torch import save_file
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    c = ConvertedDir(conv)
    dense = set(c.dense_names())
    experts: dict[tuple[int, int], dict] = {}
    tensors, changed = {}, set()
    with open_source(src) as s:
        for name in s.tensor_names():
            role = s.arch.classify(name)
            if role.kind == "expert":
                if (role.layer, role.expert) not in experts:
                    experts[role.layer, role.expert] = c.read_expert(role.layer, role.expert)
                tensors[name] = torch.from_numpy(experts[role.layer, role.expert][role.proj].copy())
            elif name in dense:
                tensors[name] = torch.from_numpy(c.read_dense(name).copy())
            else:
                assert role.kind == "skip", name
                tensors[name] = s.read(name)
            if not torch.equal(tensors[name].float(), s.read(name).float()):
                changed.add(role.kind)
        fused = s.arch.family.names.fused_experts
        if fused is not None and not fused.optional:      # gpt-oss: back into its fused layout
            tensors = _fused(tensors, s.arch)
    c.close()
    assert {"expert", "attention"} <= changed, changed      # the quantized values, not the bf16 ones
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cache = {}

    def get(arch, method, gpu_method):
        key = (arch, method, gpu_method)
        if key not in cache:
            root = shared_root(tmp_path_factory)
            src = build_checkpoint(root, arch)
            conv = converted(tmp_path_factory, arch, method, gpu_method=gpu_method)
            manifest = json.loads((conv / "manifest.json").read_text())
            assert (manifest["method"], manifest["gpu_method"]) == (method, gpu_method)
            ref_dir = quantized_reference_checkpoint(src, conv, root / f"qref_{arch}_{method}_{gpu_method}")
            cache[key] = (conv, transformers_model(ref_dir))
        return cache[key]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method, gpu_method", SCHEMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_conversion_runs_as_transformers_on_its_weights(setup, arch, method, gpu_method, backend):
    conv, ref = setup(arch, method, gpu_method)
    # GPU Linears dequantized at load (their CPU-kernel path, ktrun's CPU default, is held to its own bounds in
    # tests/test_runtime_kernel_linear.py); the experts on the torch reference or the CPU kernels
    eng = Engine(conv, ctx=256, use_kernels=backend == "kernels", gpu_weights="dequant")
    cfg, ids = eng.model.cfg, eng.tokenizer.encode(PROMPT)
    got, choices, gen, gen_choices = prompt_and_greedy_with_choices(eng, ids, 32)
    with force_transformers(ref, cfg, choices) as own:
        want = reference_logits(ref, ids)
    ties = compare(choices, own)
    diff = (got - want).abs()
    what = f"{arch} {method}+{gpu_method} {backend}: |logit diff| max {diff.max():.3g} " \
           f"(logit scale {want.abs().max():.3g}); prompt {ties}"
    ties.check(SCORE_BOUND[backend])
    assert diff.max() < LOGIT_ATOL[backend], what
    assert len(gen) == 32
    with force_transformers(ref, cfg, gen_choices) as own:
        gaps = greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)
    ties = compare(gen_choices, own)
    what += f"; continuation {ties}; greedy gap max {max(gaps):.3g}"
    ties.check(SCORE_BOUND[backend])
    assert max(gaps) <= GREEDY_GAP[backend], f"{what}; greedy gaps {gaps}"
    print(what)
