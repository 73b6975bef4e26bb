"""kt_decode_layers (ABI 21; ktrun.models.step_one_call): a decode step's decoder layers in one library call, each
layer's kt_gqa_layer then kt_moe_decode, the calls the model otherwise makes one after another from Python. Its
promise is their bits, so the reference is the same model with the step call switched off (the per-layer calls):
logits over a prompt, decode steps of one request and of two batched and a speculative verify's rows must be equal
bit for bit, on GQA families (Qwen3-MoE, MiniMax-M2, GLM-4.5) and MLA ones (DeepSeek-V3, Kimi-K2.5, the default
model), with an interleaved rotary and a sliding window, and across the KV pool's growth (new slabs: every layer's
cache pointers set again). The plan is learned from a forward that took both one-call paths in its last layers;
dense first layers join it when their MLPs run as one-expert layers (KernelExperts.fuse_dense). The C glue is ISA-independent (the kernels it calls are tested per ISA by
test_kernels_gqa_layer.py and test_kernels_moe_decode.py). Bad arguments are an error naming what is wrong."""
from __future__ import annotations

import ctypes

import pytest
import torch
from ktrun.engine import Engine
from ktrun.generate import decode_one_token, prefill
from ktrun.models import step_one_call
from ktrun.models.kv_cache import Batch
from ktrun.ops.library import DecodeLayer, DecodeLayersArgs, GqaDecodeArgs, KernelError, load_library
from one_call_helpers import absorbed_conversion, assert_rope_form_and_window_reach, with_and_without
from runtime_helpers import PROMPT, converted


def _engine(tmp_path_factory, arch: str) -> Engine:
    return Engine(converted(tmp_path_factory, arch, "int4-amx", gpu_method="rtn-int4"), ctx=256, max_batch=4)


def _planned(tmp_path_factory, arch: str):
    """The arch fixture's model after a prompt and one decode step (the step call's plan learned) -> (model, its
    cache, the prompt's ids)."""
    eng = _engine(tmp_path_factory, arch)
    model = eng.model
    cache = model.new_cache(64)
    ids = eng.tokenizer.encode(PROMPT)[:4]
    prefill(model, cache, ids)
    decode_one_token(model, cache, ids[0])
    assert model.step_plan is not None
    return model, cache, ids


@pytest.mark.parametrize("arch", ["qwen3_moe", "minimax_m2"])
def test_decode_logits_are_the_same_with_and_without_the_step_call(tmp_path_factory, monkeypatch, arch):
    """Every forward after the one that taught the plan runs in one call (decode steps, batched, a 3-row verify),
    with the per-layer calls' bits."""
    eng = _engine(tmp_path_factory, arch)
    one_call, separate, taken = with_and_without(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch,
                                                 step_one_call, "run")
    assert eng.model.step_plan is not None and len(eng.model.step_plan.slots) == len(eng.model.layers)
    assert all(taken) and len(taken) == len(one_call) - 2     # after the 2 prompts that taught it: every forward
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)


def test_interleaved_rope_and_a_window_reach_the_step_call(tmp_path_factory, monkeypatch):
    """The RoPE form and each layer's window are the forward's: the Qwen3-MoE fixture with interleaved rotary and a
    sliding window of 3 gives the per-layer calls' logits through the step call, and other logits than before."""
    eng = _engine(tmp_path_factory, "qwen3_moe")

    def relearn():                                  # the windows are recorded when the plan is learned
        eng.model.step_plan = None
    assert_rope_form_and_window_reach(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch, step_one_call, "run",
                                      relearn)


def test_the_pool_growing_under_the_plan_moves_every_layers_caches(tmp_path_factory):
    """Decode steps while the KV pool grows twice (new slabs, the old ones freed) give the per-layer calls' logits,
    step by step: a step whose pool changed re-points every layer's cache fields."""
    eng = _engine(tmp_path_factory, "qwen3_moe")
    model = eng.model
    ids = eng.tokenizer.encode(PROMPT)[:6]
    runs, slabs, kv = {}, {}, {}
    for name in ("step", "separate"):
        fn = step_one_call.run if name == "step" else (lambda *a, **k: None)
        saved, step_one_call.run = step_one_call.run, fn
        try:
            model.step_plan = None
            cache = model.new_cache(200)
            logits = [prefill(model, cache, ids)]
            seen = []
            for t in range(40):
                if t in (10, 25):                # new slabs, as when another request's blocks fill the pool
                    cache.pool._grow(cache.pool.capacity + 1)
                logits.append(decode_one_token(model, cache, 3 + t % 11))
                seen.append(cache.pool.tokens[0].data_ptr())
            runs[name], slabs[name] = logits, len(set(seen))
            kv[name] = [t[:, cache.blocks].clone() for t in cache.pool.tokens]   # what the steps wrote, where read
            cache.release()
        finally:
            step_one_call.run = saved
    assert slabs["step"] == 3                    # the plan ran on three pools' slabs
    for a, b in zip(runs["step"], runs["separate"]):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(kv["step"], kv["separate"]))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3", "kimi_k25"])
def test_dense_first_layers_join_the_call_when_their_mlp_is_one_expert(tmp_path_factory, monkeypatch, arch, fused):
    """GLM-4.5 (GQA with biases, partial rotary) and the MLA families (latent rank 64: kv_b on the absorbed op) have
    dense first layers. Their MLPs run as one-expert layers of the experts' kernels (KernelExperts.fuse_dense): the
    plan starts at layer 0, with the same logits as the per-layer calls. With KTRUN_FUSE_SHARED=0 the MLPs run on
    swiglu_mlp in Python, and no plan starts before them."""
    if not fused:
        monkeypatch.setenv("KTRUN_FUSE_SHARED", "0")
    conv = converted(tmp_path_factory, arch, "int4-amx", gpu_method="rtn-int4") if arch == "glm4_moe" else \
        absorbed_conversion(tmp_path_factory, arch)
    eng = Engine(conv, ctx=256, max_batch=4)
    model = eng.model
    one_call, separate, taken = with_and_without(model, eng.tokenizer.encode(PROMPT), monkeypatch, step_one_call,
                                                 "run")
    dense = [slot for slot, i in enumerate(model.layers) if i not in model.moe_layers]
    assert dense and model.dense_fused == ({model.layers[s] for s in dense} if fused else set())
    pl = model.step_plan
    if fused:
        assert pl is not None and pl.first == 0 and pl.slots == list(range(len(model.layers)))
        assert (pl.mla is None) == (arch == "glm4_moe") and any(taken)
    else:   # the shared experts are outside the jobs too: their layers take no plan (moe_one_call's outside path)
        assert pl is None or pl.first == len(dense)
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("quantize_head", "kind"), [(False, 1), (True, 2)])
def test_the_output_head_runs_in_the_call_with_the_callers_bits(tmp_path_factory, monkeypatch, quantize_head, kind):
    """ABI 23: the head after the last layer in the same call, as kt_float_linear (a bf16 head) or as the quantized
    head's Linear job (--quantize-head): the logits of decode steps, a batched step and a verify are the bits of the
    head the caller runs after the call; a forward that wants only each request's last row keeps the caller's."""
    eng = Engine(converted(tmp_path_factory, "qwen3_moe", "int4-amx", gpu_method="rtn-int4",
                           quantize_head=quantize_head), ctx=256, max_batch=4)
    ran = []
    real = step_one_call.run

    def run(model, batch, *a):
        got = real(model, batch, *a)
        ran.append(step_one_call.HEAD_LOGITS in batch.carried)
        return got
    monkeypatch.setattr(step_one_call, "run", run)
    one_call, separate, taken = with_and_without(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch,
                                                 step_one_call, "run")
    assert eng.model.step_plan.head is not None and eng.model.step_plan.head[0] == kind
    assert all(taken) and any(ran)
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)
    # a 3-row chunk after a prompt, logits of its last row only: the plan runs without its head
    cache = eng.model.new_cache(64)
    ids = eng.tokenizer.encode(PROMPT)
    prefill(eng.model, cache, ids[:5])
    ran.clear()
    last = eng.model.forward(Batch.build([(cache, ids[5:8])], "cpu"))
    assert ran == [False] and last.shape == (1, eng.model.cfg.vocab_size)
    cache.release()


def test_the_default_model_takes_it(default_converted, monkeypatch):
    """The embedded default model as `make demo` converts it (MLA, a dense first layer, a fused shared expert):
    the same logits with the step call, which runs all four layers (the dense one's MLP as a one-expert layer)."""
    eng = Engine(str(default_converted), ctx=256, max_batch=4)
    one_call, separate, taken = with_and_without(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch,
                                                 step_one_call, "run")
    assert any(taken) and eng.model.step_plan.first == 0 and eng.model.dense_fused == {0}
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)


def test_another_executor_unlearns_the_plan(tmp_path_factory):
    """A plan made for one experts executor is not run for another: the model goes back to the per-layer calls and
    learns a plan again."""
    model, cache, ids = _planned(tmp_path_factory, "qwen3_moe")
    old = model.step_plan
    old.experts = object()                       # as if made for an executor since swapped out
    decode_one_token(model, cache, ids[1])
    assert model.step_plan is not old and model.step_plan.experts is model.experts
    cache.release()


def test_bad_arguments_are_an_error_naming_them():
    """No arguments, no geometry, a layer without its context or blocks, an MTP block's first steps without their
    tokens, a head row outside the step: refused, naming what is wrong."""
    lib = load_library()
    assert lib.kt_decode_layers(None) == -1
    assert b"no arguments" in lib.kt_last_error()
    assert lib.kt_decode_layers(ctypes.byref(DecodeLayersArgs())) == -1
    assert b"bad geometry" in lib.kt_last_error()
    x = torch.zeros(1, 64)
    rows = GqaDecodeArgs()
    layers = (DecodeLayer * 2)()
    a = DecodeLayersArgs(T=1, H=64, x=x.data_ptr(), h=x.data_ptr(), rows=ctypes.pointer(rows), n_layers=2,
                         layers=ctypes.cast(layers, ctypes.POINTER(DecodeLayer)), x_out=x.data_ptr(),
                         h_out=x.data_ptr())
    assert lib.kt_decode_layers(ctypes.byref(a)) == -1
    assert b"layer 0: missing a context" in lib.kt_last_error()
    a.head_kind = 3                                 # the head's arguments are refused before any layer runs
    assert lib.kt_decode_layers(ctypes.byref(a)) == -1
    assert b"the head: head_kind not 0, 1 or 2" in lib.kt_last_error()
    a.head_kind = 2                                 # a quantized head without its Linear context
    assert lib.kt_decode_layers(ctypes.byref(a)) == -1
    assert b"the head:" in lib.kt_last_error()
    a.head_kind = 0
    a.tokens = ctypes.cast((ctypes.c_int64 * 1)(5), ctypes.c_void_p).value   # tokens without their table
    assert lib.kt_decode_layers(ctypes.byref(a)) == -1
    assert b"tokens without an embedding table" in lib.kt_last_error()
    a.tokens = None
    a.mtp_hidden = x.data_ptr()                     # ABI 26: an MTP block's first steps without tokens or weights
    assert lib.kt_decode_layers(ctypes.byref(a)) == -1
    assert b"MTP block's first steps need tokens, mtp_enorm, mtp_hnorm and mtp_ctx" in lib.kt_last_error()
    a.mtp_hidden = None
    row = (ctypes.c_int64 * 1)(1)                   # the head on row 1 of a 1-row step
    a.head_rows, a.head_T = ctypes.cast(row, ctypes.c_void_p).value, 1
    assert lib.kt_decode_layers(ctypes.byref(a)) == -1
    assert b"head row 1 is outside the 1 rows" in lib.kt_last_error()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_whole_step_from_the_tokens_has_the_callers_bits(tmp_path_factory, monkeypatch, arch):
    """ABI 25: a plan from layer 0 with the head in it also takes the embedding rows of the step's tokens (the
    fixtures keep their bf16 tables as stored) and layer 0's norm (step_one_call.whole_step): every decode forward
    after the plan is learned runs tokens to logits in the call, with the bits of the caller's embedding and norm."""
    conv = absorbed_conversion(tmp_path_factory, arch) if arch == "deepseek_v3" else \
        converted(tmp_path_factory, arch, "int4-amx", gpu_method="rtn-int4")
    eng = Engine(conv, ctx=256, max_batch=4)
    model = eng.model
    whole, separate, taken = with_and_without(model, eng.tokenizer.encode(PROMPT), monkeypatch, step_one_call,
                                              "whole_step")
    assert model.step_plan.first_steps is not None and model.w[model.names.embed].dtype == torch.bfloat16
    assert sum(taken) >= 6                      # the 6 decode forwards after the first two (the 3-row verify too)
    for a, b in zip(whole, separate):
        assert torch.equal(a, b)


def test_a_token_outside_the_table_is_refused_before_the_step(tmp_path_factory):
    """A whole step's token id beyond the embedding table: a KernelError naming it, the cache as it was."""
    model, cache, ids = _planned(tmp_path_factory, "qwen3_moe")
    decode_one_token(model, cache, ids[1])
    assert model.step_plan.first_steps is not None
    length = cache.length
    V = model.w[model.names.embed].shape[0]
    with pytest.raises(KernelError, match=f"token {V} at row 0 is outside the embedding table's {V} rows"):
        decode_one_token(model, cache, V)
    assert cache.length == length
    cache.release()


def test_mla_decode_past_the_calling_threads_scores_limit_stays_in_the_call(tmp_path_factory, monkeypatch):
    """MLA decode rows whose scores (heads x positions) pass glue.MLA_ATTEND_MAX_SCORES, the limit of kt_mla_attend on
    the calling thread alone (here lowered to 16 so the fixture's prompt passes it), still take the step's call: its
    attention runs on the pool, which takes a cache of any length. A 128-head model (DeepSeek-V3, Kimi-K2) left the
    call after 128 positions, for the per-layer path and torch's GEMMs. The same bits as the per-layer calls, whose
    attention runs on the pool's kernel too."""
    from ktrun.ops import glue
    monkeypatch.setattr(glue, "MLA_ATTEND_MAX_SCORES", 16)
    eng = Engine(absorbed_conversion(tmp_path_factory, "deepseek_v3"), ctx=256, max_batch=4)
    ids = eng.tokenizer.encode(PROMPT)
    whole, separate, taken = with_and_without(eng.model, ids, monkeypatch, step_one_call, "whole_step")
    assert eng.model.cfg.num_heads * len(ids) > glue.MLA_ATTEND_MAX_SCORES
    assert sum(taken) >= 6
    for a, b in zip(whole, separate):
        assert torch.equal(a, b)
