"""kt_moe_decode (ABI 16; ktrun.ops.glue.moe_decode, ktrun.models.moe_one_call): a MoE layer's decode rows from the
attention's output to the next layer's normed input in one call (residual add + norm, router, routed experts with a
fused shared expert, residual add + next norm), or up to the routed job when a shared expert runs outside it. Its
promise is the bits of MoEModel's separate calls, so the reference is the same converted model with the one call
switched off: logits equal bit for bit for a prompt, decode steps of one request and of two batched and a speculative
verify's rows, for the sigmoid router with groups and a correction bias (DeepSeek-V3, MiniMax-M2), the softmax router
(Qwen3-MoE, Mixtral, DeepSeek-V2's grouped greedy), a fused shared expert (the embedded default model's padded to
whole units) and one outside the job, on every ISA copy; what it does not take goes the separate way; bad arguments are an error.
A dense layer's MLP as a one-expert layer (the dense router) against the Linear op's SwiGLU."""
from __future__ import annotations

import ctypes

import pytest
import torch
from ktrun.engine import Engine
from ktrun.models import moe_one_call
from ktrun.ops import glue
from ktrun.ops.library import MoeDecodeArgs, load_library
from ktrun.ops.moe import MoEKernels
from one_call_helpers import assert_refused, same_bits_on_every_isa, with_and_without
from runtime_helpers import PROMPT, converted


def _with_and_without(model, ids, monkeypatch) -> tuple[list, list, list[bool]]:
    return with_and_without(model, ids, monkeypatch, moe_one_call, "run")


@pytest.mark.parametrize("arch", ["deepseek_v3", "minimax_m2", "qwen3_moe", "mixtral", "deepseek_v2"])
def test_decode_logits_are_the_same_with_and_without_the_one_call(tmp_path_factory, monkeypatch, arch):
    eng = Engine(converted(tmp_path_factory, arch, "int4-amx", gpu_method="rtn-int4"), ctx=256, max_batch=4)
    ids = eng.tokenizer.encode(" ".join([PROMPT] * 4))
    assert len(ids) > glue.ROUTE_MAX_ROWS
    one_call, separate, taken = _with_and_without(eng.model, ids, monkeypatch)
    assert any(taken) and not all(taken)          # decode rows take it; the prompts (more rows) do not
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)


def test_the_default_model_takes_it_with_its_padded_shared_expert_in_the_job(default_converted, monkeypatch):
    eng = Engine(str(default_converted), ctx=256, max_batch=4)
    model = eng.model
    assert model.shared_fused == model.moe_layers                    # intermediate 160, padded to whole units
    one_call, separate, taken = _with_and_without(model, eng.tokenizer.encode(PROMPT), monkeypatch)
    assert any(taken)
    assert all(moe_one_call.plan(model, i).outside is None for i in model.moe_layers)
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)


def test_a_shared_expert_the_job_cannot_hold_runs_after_it(default_converted, monkeypatch):
    """A shared expert left out of the job (KTRUN_FUSE_SHARED=0, as the RAM tier computes it; or fuse_shared refused:
    e.g. Linears of different bits after the mix's upgrades) runs after the call returns with the job in flight: the
    separate path's bits."""
    monkeypatch.setenv("KTRUN_FUSE_SHARED", "0")
    eng = Engine(str(default_converted), ctx=256, max_batch=4)
    model = eng.model
    assert not model.shared_fused
    one_call, separate, taken = _with_and_without(model, eng.tokenizer.encode(PROMPT), monkeypatch)
    assert any(taken)
    assert all(moe_one_call.plan(model, i).outside is not None for i in model.moe_layers)
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)


def test_what_it_does_not_take_goes_the_separate_way(tmp_path_factory, monkeypatch):
    """gpt-oss (its own router), Qwen3-Next (a gated shared expert) and the torch reference experts: no plan."""
    for arch, opts in (("gpt_oss", {}), ("qwen3_next", {}), ("deepseek_v3", {"use_kernels": False})):
        eng = Engine(converted(tmp_path_factory, arch, "int4-amx", gpu_method="rtn-int4"), ctx=256, max_batch=4,
                     **opts)
        _, _, taken = _with_and_without(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch)
        assert not any(taken), arch
        assert all(moe_one_call.plan(eng.model, i) is None for i in eng.model.moe_layers), arch


def test_every_isa_copy_gives_the_same_bits(tmp_path_factory):
    same_bits_on_every_isa(converted(tmp_path_factory, "deepseek_v3", "int4-amx", gpu_method="rtn-int4"),
                           "ktrun.models.moe_one_call", "run")


def test_bad_arguments_are_an_error_naming_them():
    """No context, all-zero arguments, finish 0 without e_out (or any tensor): refused, kt_last_error naming what is
    wrong."""
    assert_refused("kt_moe_decode", MoeDecodeArgs, {"T": 1, "H": 64, "E": 8, "top_k": 2, "n_group": 1, "topk_group": 1,
                                                    "router": 1, "finish": 0})


def test_a_dense_layers_mlp_runs_as_one_expert(default_converted):
    """The default model's dense first layer: its MLP's Linears registered as a one-expert layer of the experts'
    kernels (KernelExperts.fuse_dense), its rows one job of that expert at weight 1 (run_dense; in a decode step
    kt_moe_decode's dense router, whose bits the with / without tests above hold to the per-layer path). Against the
    same Linears on the Linear op (swiglu_mlp, torch's SiLU): within the last bits of the SiLU as the int8 activation
    rounding of down's input carries them; every row's bits are those it has alone (no batch dependence)."""
    from ktrun.models.layers import swiglu_mlp
    eng = Engine(str(default_converted), ctx=256, max_batch=4)
    model = eng.model
    assert model.dense_fused == {0}
    p = model.names.layer(0) + "mlp."
    h = torch.randn(9, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    ref = swiglu_mlp(h, model.w[p + "gate_proj.weight"], model.w[p + "up_proj.weight"], model.w[p + "down_proj.weight"])
    got = model.experts.run_dense(0, h)
    assert got.shape == ref.shape and (got - ref).abs().max() <= 1e-5 * ref.abs().max()   # ~1e-7 seen
    for t in range(h.shape[0]):
        assert torch.equal(model.experts.run_dense(0, h[t:t + 1].clone()), got[t:t + 1])
    stats = dict(model.experts.stats)
    model.experts.run_dense(0, h)
    assert model.experts.stats == stats                      # not counted among the experts' calls


def test_the_dense_router_takes_no_gate_and_one_expert():
    """kt_moe_decode's router 2 (dense) with a gate, or more than one expert: refused, naming the dense terms."""
    lib = load_library()
    kernels = MoEKernels(n_threads=2)
    x = torch.zeros(1, 64)
    try:
        for bad in ({"E": 2, "top_k": 1}, {"E": 1, "top_k": 1, "gate": x.data_ptr()}):
            a = MoeDecodeArgs(T=1, H=64, n_group=1, topk_group=1, router=2, finish=1, **bad)
            assert lib.kt_moe_decode(kernels.handle, ctypes.byref(a)) == -1
            assert b"dense: E, top_k and groups 1" in lib.kt_last_error()
    finally:
        kernels.close()
