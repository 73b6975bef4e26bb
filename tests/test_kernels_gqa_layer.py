"""kt_gqa_layer (ABI 20; ktrun.ops.glue.GqaLayerCall, ktrun.models.attention_one_call.gqa_layer): a GQA layer's
decode rows from the layer's normed input to o_proj's output in one call: the q / k / v Linears' job and their
biases, kt_gqa_decode (q / k norms, RoPE, the KV cache write, the attention), o_proj's job and bias. Its promise is
the bits of those calls made one after another, so the reference is the same model with the one call switched off
(ktrun.models.attention.gqa_attention's separate steps): logits over a prompt, decode steps of one request and of
two batched and a speculative verify's rows must be equal bit for bit, on families with per-head q / k norms
(Qwen3-MoE), q / k / v biases and partial rotary (GLM-4.5) and a norm over the whole projection (MiniMax-M2), on
every ISA copy (layers without norms and other head shapes: kt_gqa_decode's own tests, which this call runs). Also: bad arguments are an error naming what is wrong."""
from __future__ import annotations

import ctypes

import pytest
import torch
from ktrun.engine import Engine
from ktrun.generate import decode_one_token, prefill
from ktrun.models import attention_one_call
from ktrun.ops.library import GqaDecodeArgs, GqaLayerArgs, KernelError, load_library
from ktrun.ops.moe import MoEKernels
from one_call_helpers import assert_refused, assert_rope_form_and_window_reach, same_bits_on_every_isa, with_and_without
from runtime_helpers import PROMPT, converted


def _plans(model) -> list:
    return [v for k, v in model.w.items() if k.endswith("gqa_layer_plan") and v is not None]


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "minimax_m2"])
def test_model_decode_logits_are_the_same_with_and_without_the_one_call(tmp_path_factory, monkeypatch, arch):
    """A converted fixture on the kernels (int4 experts and Linears): logits bit-identical with the one call and with
    it switched off, every attention layer taking every forward of decode-sized rows."""
    eng = Engine(converted(tmp_path_factory, arch, "int4-amx", gpu_method="rtn-int4"), ctx=256, max_batch=4)
    one_call, separate, taken = with_and_without(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch,
                                                 attention_one_call, "gqa_layer")
    layers = len(_plans(eng.model))                  # the first forward is the whole prompt: no decode rows there
    assert layers and taken[:layers] == [False] * layers and all(taken[layers:])
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)
    plans = _plans(eng.model)
    if arch == "glm4_moe":                     # its q / k / v biases are added inside the call
        assert all(p.args.q_bias and p.args.k_bias and p.args.v_bias for p in plans)


def test_interleaved_rope_and_a_window_reach_the_call(tmp_path_factory, monkeypatch):
    """The RoPE form and the window are the model's, read per call: the Qwen3-MoE fixture with its rotary made
    interleaved and a sliding window of 3 gives the same logits with the one call and without (the separate steps
    follow both), and other logits than with plain rotary and no window."""
    eng = Engine(converted(tmp_path_factory, "qwen3_moe", "int4-amx", gpu_method="rtn-int4"), ctx=256, max_batch=4)
    assert_rope_form_and_window_reach(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch, attention_one_call,
                                      "gqa_layer")


def test_every_isa_copy_gives_the_same_bits(tmp_path_factory):
    same_bits_on_every_isa(converted(tmp_path_factory, "glm4_moe", "int4-amx", gpu_method="rtn-int4"),
                           "ktrun.models.attention_one_call", "gqa_layer")


def test_bad_arguments_are_an_error_naming_them(tmp_path_factory):
    """No context, all-zero arguments, no input: refused. Linear ids the context never got, or Linears whose shapes
    do not fit the heads: refused, naming it."""
    assert_refused("kt_gqa_layer", GqaLayerArgs, {"attn": GqaDecodeArgs(nh=2, nkv=1, hd=16, vd=16, T=1)})
    lib = load_library()
    x, out = torch.zeros(1, 64), torch.zeros(1, 64)
    kernels = MoEKernels(n_threads=2)
    try:
        a = GqaLayerArgs(attn=GqaDecodeArgs(nh=2, nkv=1, hd=16, vd=16, T=1), x=x.data_ptr(), x_stride=64,
                         q_id=7, k_id=8, v_id=9, o_id=10, out=out.data_ptr(), out_stride=64, n_out=64)
        assert lib.kt_gqa_layer(kernels.handle, ctypes.byref(a)) == -1
        assert b"was not added" in lib.kt_last_error()
    finally:
        kernels.close()
    eng = Engine(converted(tmp_path_factory, "qwen3_moe", "int4-amx", gpu_method="rtn-int4"), ctx=256, max_batch=2)
    ids = eng.tokenizer.encode(PROMPT)[:4]
    cache = eng.model.new_cache(64)
    prefill(eng.model, cache, ids)
    a = _plans(eng.model)[0].args
    a.q_id, a.k_id = a.k_id, a.q_id                      # k_proj where q_proj belongs: the shapes do not fit
    try:
        with pytest.raises(KernelError, match="Linear shapes do not match"):
            decode_one_token(eng.model, cache, ids[0])
    finally:
        a.q_id, a.k_id = a.k_id, a.q_id
        cache.release()
