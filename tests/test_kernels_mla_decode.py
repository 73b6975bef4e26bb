"""kt_mla_decode (ABI 16; ktrun.ops.glue.MlaLayerCall, ktrun.models.attention_one_call.mla): an MLA layer's
decode rows (and a prompt chunk's, when they take the absorbed form) from x to o_proj's output in one call. Its promise is the bits of mla_attention's separate steps on the
kernels (the q_a + kv_a job, the norms, q_b's job, the latent rows written into the paged cache, W_uk's grouped job,
RoPE, kt_mla_attend_batch, W_uv's grouped job, o_proj's job), so the reference is the same converted model with the
one call switched off: logits equal bit for bit for a prompt, decode steps of one request and of two batched (their
blocks interleaved in the pool) and a speculative verify's rows, with q_lora (DeepSeek-V3, Kimi-K2.5) and without it
(DeepSeek-V2), on every ISA copy; and what it does not take (the lightning indexer, a float32 model off the kernels,
a kv_b too small for the absorbed op) goes the separate way. Bad arguments are an error naming what is wrong."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from ktrun.engine import Engine
from ktrun.models import attention_one_call
from ktrun.ops.library import MlaDecodeArgs
from one_call_helpers import absorbed_conversion, assert_refused, same_bits_on_every_isa, with_and_without
from runtime_helpers import PROMPT, converted


def _with_and_without(model, ids, monkeypatch) -> tuple[list, list, list[bool]]:
    return with_and_without(model, ids, monkeypatch, attention_one_call, "mla")


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "kimi_k25"])
def test_decode_logits_are_the_same_with_and_without_the_one_call(tmp_path_factory, monkeypatch, arch):
    eng = Engine(absorbed_conversion(tmp_path_factory, arch), ctx=256, max_batch=4)
    one_call, separate, taken = _with_and_without(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch)
    assert taken and all(taken)                   # decode rows and the prompt (absorbed, one chunk) take it
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)


def test_the_default_model_takes_it(default_converted, monkeypatch):
    """The embedded default model as `make demo` converts it: the same logits, the one call taken."""
    eng = Engine(str(default_converted), ctx=256, max_batch=4)
    one_call, separate, taken = _with_and_without(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch)
    assert any(taken)
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)


def test_what_it_does_not_take_goes_the_separate_way(tmp_path_factory, monkeypatch):
    """DeepSeek-V3.2 (the lightning indexer), a model whose Linears are not on the kernels and the fixtures' rank-32
    kv_b (not on the absorbed op): never taken."""
    eng = Engine(converted(tmp_path_factory, "deepseek_v32", "int4-amx", gpu_method="rtn-int4"), ctx=256, max_batch=4)
    _, _, taken = _with_and_without(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch)
    assert taken == []                                  # indexed layers never ask
    for conv, opts in ((absorbed_conversion(tmp_path_factory, "deepseek_v3"), {"gpu_weights": "dequant"}),
                       (converted(tmp_path_factory, "deepseek_v3", "int4-amx", gpu_method="rtn-int4"), {})):
        eng = Engine(conv, ctx=256, max_batch=4, **opts)
        one_call, separate, taken = _with_and_without(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch)
        assert taken and not any(taken)
        for a, b in zip(one_call, separate):
            assert torch.equal(a, b)


def test_every_isa_copy_gives_the_same_bits(tmp_path_factory):
    same_bits_on_every_isa(absorbed_conversion(tmp_path_factory, "deepseek_v3"), "ktrun.models.attention_one_call",
                           "mla")


def test_bad_arguments_are_an_error_naming_them():
    """No context, all-zero arguments, a geometry without its norms, tables and cache: refused, kt_last_error naming
    what is wrong."""
    x = torch.zeros(1, 64)
    assert_refused("kt_mla_decode", MlaDecodeArgs, {"T": 1, "nh": 2, "dn": 16, "dr": 16, "dv": 16, "R": 32, "q_lora": 0,
                                                    "m": 1, "x": x.data_ptr(), "x_stride": 64})


def test_bench_decode_runs_with_it(tmp_path_factory):
    """`ktrun bench` on a converted fixture: a real subprocess decodes through the one call."""
    conv = absorbed_conversion(tmp_path_factory, "deepseek_v3")
    r = subprocess.run([sys.executable, "-m", "ktrun", "bench", str(conv), "--pp", "0", "--tg", "8", "--reps", "1"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert "tg8" in r.stdout
