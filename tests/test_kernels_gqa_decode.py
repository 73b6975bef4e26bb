"""kt_gqa_decode (ABI 16; ktrun.ops.glue.gqa_decode, ktrun.models.attention_one_call.gqa): a GQA layer's decode rows
after their projections in one call: the q / k norms, RoPE, the KV cache write and the attention. Its promise is the
separate steps' bits (ktrun.models.layers.rms_norm and Rope.apply, SeqCache.write, kt_gqa_attend_batch), so the
reference is gqa_attention with the one call switched off, on a copy of the same paged cache: the output and every
cache slot must be equal bit for bit, for decode rows and a speculative verify's rows of several requests whose
blocks are scattered through the pool, with and without norms (per head, per projection), partial and interleaved
RoPE, and sliding windows; on the calling thread, on the pool and on every ISA copy. Also: what it refuses falls back
to the separate steps, and bad arguments are an error naming what is wrong."""
from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import pytest
import torch
from isa_copies import outputs_per_isa
from ktlayouts.families.config import RopeConfig
from ktrun.engine import Engine
from ktrun.models import attention, attention_one_call, layers
from ktrun.models.kv_cache import Batch, BlockLayout, BlockPool, SeqCache
from ktrun.ops import glue
from ktrun.ops.library import GqaDecodeArgs, KernelError, load_library
from ktrun.ops.moe import MoEKernels
from one_call_helpers import with_and_without
from runtime_helpers import PROMPT, converted

# (heads, kv heads, head dim, value dim, qk norm, rotary dims, interleaved, window): Qwen3-MoE, Mixtral (no norm),
# MiniMax-M2 (norm over the projection, partial rotary), GLM-4.5 (partial rotary), MQA with interleaved pairs and a
# window, a window with norms
CASES = [(32, 4, 128, 128, "head", 128, False, None), (8, 2, 64, 64, None, 64, False, None),
         (12, 4, 64, 64, "projection", 32, False, None), (16, 4, 128, 128, "head", 64, False, None),
         (8, 1, 32, 32, None, 32, True, 5), (8, 4, 64, 64, "head", 64, False, 7)]


def _layer(nh, nkv, hd, vd, norm, rot, interleaved, window, seed):
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(num_heads=nh, num_kv_heads=nkv, head_dim=hd, rms_norm_eps=1e-6, sliding_window=window,
                          softmax_scale=hd ** -0.5)
    H = 48
    w = {"a.q_proj.weight": torch.randn(nh * hd, H, generator=g) / 7,
         "a.k_proj.weight": torch.randn(nkv * hd, H, generator=g) / 7,
         "a.v_proj.weight": torch.randn(nkv * vd, H, generator=g) / 7,
         "a.o_proj.weight": torch.randn(H, nh * vd, generator=g) / 9}
    if norm == "head":
        w["a.q_norm.weight"] = torch.rand(hd, generator=g) + 0.5
        w["a.k_norm.weight"] = torch.rand(hd, generator=g) + 0.5
    elif norm == "projection":
        w["a.q_norm.weight"] = torch.rand(nh * hd, generator=g) + 0.5
        w["a.k_norm.weight"] = torch.rand(nkv * hd, generator=g) + 0.5
    rope = layers.Rope(RopeConfig(theta=10000.0, dim=rot, interleaved=interleaved))
    return cfg, w, rope, g


def _pool(nkv, hd, vd, n_layers=2):
    return BlockPool(BlockLayout(n_layers, ((nkv, hd), (nkv, vd)), 4), torch.float32, "cpu")   # 4 positions a block


def _forward(cfg, w, rope, norm, batch, x, layer, kernels=None):
    cos, sin = rope.cos_sin(batch.positions, torch.float32)
    lin = SimpleNamespace(kernels=kernels)
    w = dict(w)
    if kernels is not None:                    # gqa_attention reads the pool from q_proj's KernelLinear context
        q = w["a.q_proj.weight"]
        w["a.q_proj.weight"] = SimpleNamespace(lin=lin, w=q)
    return attention.gqa_attention(cfg, w, "a.", x, batch, layer, rope, cos, sin, norm)


@pytest.fixture
def plain_linears(monkeypatch):
    """gqa_attention's Linears as plain matmuls (a SimpleNamespace weight carries a kernel context in these tests)."""
    def lin(x, ws, biases=None):
        return [x @ (wt.w if isinstance(wt, SimpleNamespace) else wt).t() for wt in ws]
    monkeypatch.setattr(attention, "linears", lin)
    monkeypatch.setattr(attention, "linear", lambda x, wt, b=None: x @ wt.t())


def _run(case, one_call: bool, kernels, monkeypatch):
    """Two requests (a 5-token and a 9-token prompt, their blocks interleaved in the pool, prefilled by torch), then
    a decode step of both, then a verify of 3 rows for one and 1 row for the other, on layer 1 of the pool.
    -> (the decode and verify outputs, the pool's slabs)."""
    nh, nkv, hd, vd, norm, rot, _, _ = case
    cfg, w, rope, g = _layer(*case, seed=nh * hd + rot)
    pool = _pool(nkv, hd, vd)
    a, b = SeqCache(pool, 64), SeqCache(pool, 64)
    x = torch.randn(40, 48, generator=g)
    for step, items in enumerate([[(a, [1] * 5)], [(b, [2] * 9)]]):     # the prompts (torch path: > 4 rows)
        batch = Batch.build(items, "cpu")
        _forward(cfg, w, rope, norm, batch, x[step * 9:step * 9 + batch.tokens.numel()], 1)
        batch.commit()
    fast = attention_one_call.gqa
    calls = []

    def spy(*args, **kw):
        out = fast(*args, **kw) if one_call else None
        calls.append(out is not None)
        return out
    monkeypatch.setattr(attention_one_call, "gqa", spy)
    outs = []
    for rows, xs in (([(a, [3]), (b, [4])], x[20:22]), ([(b, [5, 6, 7]), (a, [8])], x[22:26])):
        batch = Batch.build(rows, "cpu")
        outs.append(_forward(cfg, w, rope, norm, batch, xs, 1, kernels))
        batch.commit()
    monkeypatch.setattr(attention_one_call, "gqa", fast)
    assert calls == [one_call, one_call]
    return outs, [t.clone() for t in pool.tokens]


@pytest.mark.parametrize("case", CASES)
def test_same_bits_as_the_separate_steps(case, plain_linears, monkeypatch):
    want_out, want_cache = _run(case, False, None, monkeypatch)
    for kernels in (None, MoEKernels(n_threads=2)):
        got_out, got_cache = _run(case, True, kernels, monkeypatch)
        for got, want in zip(got_out, want_out):
            assert torch.equal(got, want)
        for got, want in zip(got_cache, want_cache):
            assert torch.equal(got, want)                       # every slot written the same (the rest stays 0)
        if kernels is not None:
            kernels.close()


_DIGEST = """
import hashlib, sys, torch
sys.path.insert(0, {tests!r})
import pytest
from test_kernels_gqa_decode import CASES, _run
mp = pytest.MonkeyPatch()
from ktrun.models import attention
mp.setattr(attention, "linears", lambda x, ws, b=None: [x @ w.t() for w in ws])
mp.setattr(attention, "linear", lambda x, w, b=None: x @ w.t())
h = hashlib.sha256()
for case in CASES:
    outs, cache = _run(case, True, None, mp)
    for t in outs + cache:
        h.update(t.numpy().tobytes())
print(h.hexdigest())
"""


def test_every_isa_copy_gives_the_same_bits():
    """The scalar twin (baseline copy), AVX2 and AVX-512 copies chosen by KT_KERNEL_BACKEND in fresh processes."""
    digests = outputs_per_isa(_DIGEST.format(tests=os.path.dirname(__file__)))
    assert len(digests) >= 2 and len(set(digests.values())) == 1, digests


def test_what_it_does_not_take_goes_the_separate_way(plain_linears, monkeypatch):
    """Sinks (gpt-oss), a prompt longer than SERIAL_MAX_ROWS, bfloat16, a norm torch computes itself (a projection
    wider than kt_rms_norm's rows): None, nothing written."""
    case = (8, 2, 64, 64, "head", 64, False, None)
    cfg, w, rope, g = _layer(*case, seed=3)
    pool = _pool(2, 64, 64)
    s = SeqCache(pool, 64)
    x = torch.randn(6, 48, generator=g)

    def one_call(rows, norm="head", dtype=torch.float32, sinks=None, ww=w):
        batch = Batch.build([(s, [1] * rows)], "cpu")
        cos, sin = rope.cos_sin(batch.positions, dtype)
        q, k, v = (x[:rows].to(dtype) @ ww[f"a.{n}_proj.weight"].to(dtype).t() for n in "qkv")
        return attention_one_call.gqa(cfg, ww, "a.", q, k, v, batch, 0, rope, cos, sin, norm, "config", sinks,
                                          None)
    assert one_call(layers.SERIAL_MAX_ROWS + 1) is None
    assert one_call(1, sinks=torch.zeros(8)) is None
    assert one_call(1, dtype=torch.bfloat16) is None
    wide = dict(w, **{"a.q_norm.weight": torch.ones(40000)})
    assert one_call(1, norm="projection", ww=wide) is None
    assert not any(t.any() for t in pool.tokens)
    assert one_call(1) is not None and pool.tokens[0].any()


def test_bad_arguments_are_an_error_naming_them():
    lib = load_library()
    a = GqaDecodeArgs()                                  # all zero: no geometry
    assert lib.kt_gqa_decode(None, ctypes.byref(a)) == -1
    assert b"bad geometry" in lib.kt_last_error()
    q = torch.zeros(1, 64)
    with pytest.raises(KernelError, match="request rows"):
        paging = (1, torch.tensor([0, 2]), torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0]))  # row0 != T
        glue.gqa_decode(q, q[:, :32], q[:, :32], 2, 32, None, None, None, 1e-6, torch.ones(1, 16),
                        torch.zeros(1, 16), 16, False, paging, torch.zeros(2, 4, 1, 32), torch.zeros(2, 4, 1, 32),
                        0.1, None)
    assert lib.kt_gqa_decode(None, None) == -1


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "minimax_m2"])
def test_model_decode_logits_are_the_same_with_and_without_the_one_call(tmp_path_factory, monkeypatch, arch):
    """A converted fixture on the kernels (int4 experts and Linears): a prompt, then decode steps of one request and of
    two batched, and a 3-row verify: logits bit-identical with the one call and with it switched off."""
    eng = Engine(converted(tmp_path_factory, arch, "int4-amx", gpu_method="rtn-int4"), ctx=256, max_batch=4)
    # the whole layer's call (kt_gqa_layer, tests/test_kernels_gqa_layer.py) takes these rows first: off here
    monkeypatch.setattr(attention_one_call, "gqa_layer", lambda *a, **k: None)
    one_call, separate, taken = with_and_without(eng.model, eng.tokenizer.encode(PROMPT), monkeypatch,
                                                 attention_one_call, "gqa")
    assert any(taken)
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)
