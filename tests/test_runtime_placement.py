"""Where weights live: experts mapped (never copied), NUMA shard files served on other node counts, GPU layers
quantized for the GPU dequantized on the CPU, and the CUDA path (skipped visibly without a GPU)."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from ktrun.engine import Engine
from ktrun.loader import load_converted, piece_arrays
from ktrun.models.kv_cache import Batch
from ktrun.ops.library import kernels_available
from runtime_helpers import (
    PROMPT,
    build_checkpoint,
    converted,
    greedy_gaps,
    kl,
    reference_logits,
    shared_root,
    transformers_model,
)

TEXT = PROMPT + " and then some more words to average over"


def logits(conv, **kw) -> torch.Tensor:
    eng = Engine(conv, ctx=256, **kw)
    ids = eng.tokenizer.encode(TEXT)
    out = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], eng.model.device), all_logits=True)
    eng.close()
    return out.float().cpu()


def _mapped(a: np.ndarray) -> bool:
    while a is not None and not isinstance(a, mmap.mmap):
        if isinstance(a, memoryview):        # np.frombuffer(mmap): the array's base is a memoryview of the map
            a = a.obj
        else:
            a = getattr(a, "base", None) if not isinstance(a, np.memmap) or a.base is not None else a._mmap
    return isinstance(a, mmap.mmap)


def test_huge_pages_only_for_expert_files_that_fit_in_memory(tmp_path_factory, monkeypatch):
    from ktrun import loader

    advised = []
    real = loader._map_file

    def spy(path, huge):
        if path.parent.name == "experts":
            advised.append(huge)
        return real(path, huge)

    monkeypatch.setattr(loader, "_map_file", spy)
    conv = converted(tmp_path_factory, "qwen3_moe", "int4-amx")
    assert loader.memory_limit_bytes() > 0
    load_converted(conv, device="cpu")
    assert advised and all(advised)                       # a few MB of experts: advised
    advised.clear()
    monkeypatch.setattr(loader, "memory_limit_bytes", lambda: 4096)
    load_converted(conv, device="cpu")
    assert advised and not any(advised)                   # larger than memory: 4 KiB pages, no 2 MiB re-reads


def test_expert_tensors_are_views_of_the_mapped_files(tmp_path_factory):
    m = load_converted(converted(tmp_path_factory, "qwen3_moe", "int4-amx"), device="cpu")
    for shards in m.experts.values():
        for shard in shards:
            for qw, sc, _geom in shard.values():
                assert _mapped(qw) and _mapped(sc) and not qw.flags.writeable
    assert m.mapped_bytes > 0 and m.numa_plan and all(m.numa_plan)
    # opt-in: one thread per NUMA node, bound to its CPUs, faults that node's pieces in
    m = load_converted(converted(tmp_path_factory, "qwen3_moe", "int4-amx"), device="cpu", numa_prefault=True)
    assert len(m.prefault_threads) == len(m.numa_plan)
    for t in m.prefault_threads:
        t.join(timeout=60)
        assert not t.is_alive()
    # the per-node pieces a prefault thread touches partition each shard's bytes unit by unit (3 units of 64 here)
    m = load_converted(converted(tmp_path_factory, "deepseek_v3", "int8-amx", group_size=32), device="cpu")
    unit, n_units = m.geometry.shard_plan.unit, m.geometry.shard_plan.n_units
    shard = next(iter(m.experts.values()))[0]
    whole = sum(a.nbytes for a in piece_arrays(shard, 0, n_units, unit))
    assert whole == sum(x.nbytes for qw, sc, _g in shard.values() for x in (qw, sc) if x is not None)
    assert sum(a.nbytes for u in range(n_units) for a in piece_arrays(shard, u, u + 1, unit)) == whole


@pytest.mark.parametrize("pools", [1, 3])
def test_numa_shard_files_served_on_other_node_counts(tmp_path_factory, monkeypatch, pools):
    """Files written for 2 NUMA nodes give the 1-node conversion's logits: through the reference path; and through
    the kernels on 1 sub-pool (M < S) or 3 (M > S: nodes split a shard's units; KT_NUMA_POOLS simulates nodes) the
    same distributions as the 1-shard files on the kernels."""
    # deepseek_v3, group 32: I = 160 -> 3 units of 64; shards hold units [0, 1) and [1, 3)
    one = converted(tmp_path_factory, "deepseek_v3", "int8-amx", group_size=32)
    two = converted(tmp_path_factory, "deepseek_v3", "int8-amx", group_size=32, numa_nodes=2)
    ref = logits(one, use_kernels=False)
    assert (logits(two, use_kernels=False) - ref).abs().max() < 1e-4
    if not kernels_available():
        pytest.skip("libktkernels / runtime/ops/moe.py not available on this machine")
    kern_one = logits(one, use_kernels=True)
    monkeypatch.setenv("KT_NUMA_POOLS", str(pools))
    d = kl(kern_one, logits(two, use_kernels=True))
    assert d.max() < 1e-6, f"KL vs the 1-shard kernels: mean {d.mean():.2e} max {d.max():.2e} (observed ~3e-13)"


def test_int4_gpu_layers_dequantized_on_cpu(tmp_path_factory):
    """Attention/shared-expert/dense-MLP weights as Marlin int4 (RTN) + int4 experts vs the bf16 conversion.
    Bound: KL mean < 0.15, max < 0.5 nats (observed 5.7e-2 / 0.14: the tiny fixture's K=96..200 rows leave one
    scale per row, and every attention projection is quantized)."""
    conv = converted(tmp_path_factory, "deepseek_v3", "int4-amx", gpu_method="rtn-int4")
    layouts = {t["layout"] for f in __import__("json").loads((conv / "manifest.json").read_text())["files"].values()
               for t in f.get("tensors", {}).values()}
    assert "gpu-marlin-int4" in layouts
    d = kl(logits(converted(tmp_path_factory, "deepseek_v3", "bf16"), use_kernels=False), logits(conv, use_kernels=False))
    assert d.mean() < 0.15 and d.max() < 0.5, f"KL mean {d.mean():.2e} max {d.max():.2e}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (dense layers on the GPU in bf16)")
def test_cuda_dense_layers_match_transformers(tmp_path_factory):
    src = build_checkpoint(shared_root(tmp_path_factory), "deepseek_v3")
    conv = converted(tmp_path_factory, "deepseek_v3", "bf16")
    eng = Engine(conv, ctx=256, device="cuda")
    assert eng.converted.device.type == "cuda" and eng.converted.dtype == torch.bfloat16
    ids = eng.tokenizer.encode(PROMPT)
    ref = transformers_model(src)
    got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cuda"), all_logits=True).cpu()
    want = reference_logits(ref, ids)
    # bf16 compute vs the float32 reference; bf16 dense on the CPU measured KL max 2.8e-2 (one routing flip)
    d = kl(want, got)
    assert d.mean() < 5e-3 and d.max() < 5e-2, f"KL mean {d.mean():.2e} max {d.max():.2e}"
    from ktrun.sampling import SamplingParams
    eng.add_request("a", ids, SamplingParams(max_tokens=16, ignore_eos=True))
    gen = []
    while eng.has_work():
        gen += [t for _r, t, _f in eng.step()]
    assert max(greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)) <= 0.5
