"""kt_moe_decode (ABI 16; ktrun.ops.glue.moe_decode, ktrun.models.moe_one_call): a MoE layer's decode rows from the
attention's output to the next layer's normed input in one call (residual add + norm, router, routed experts with a
fused shared expert, residual add + next norm), or up to the routed job when a shared expert runs outside it. Its
promise is the bits of MoEModel's separate calls, so the reference is the same converted model with the one call
switched off: logits equal bit for bit for a prompt, decode steps of one request and of two batched and a speculative
verify's rows, for the sigmoid router with groups and a correction bias (DeepSeek-V3, MiniMax-M2), the softmax router
(Qwen3-MoE, Mixtral, DeepSeek-V2's grouped greedy), a fused shared expert (the embedded default model's padded to
whole units) and one outside the job, on every ISA copy; what it does not take goes the separate way; bad arguments are an error."""
from __future__ import annotations

import pytest
import torch
from ktrun.engine import Engine
from ktrun.models import moe_one_call
from ktrun.ops import glue
from ktrun.ops.library import MoeDecodeArgs
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
