"""kt_prompt_attend (ABI 24; ktrun.ops.prompt_attention): a prompt's causal attention on the kernel pool. Not torch's
bits, so held to its own promise: within float32 rounding of a float64 reference (GQA, MQA, MHA with dk != dv, a
chunk after a prefix, sliding windows, sinks, MLA's key in two parts); each row's bits depend only on its own query
and the keys and values it sees (the same rows in a longer prompt, a chunk after a prefix, the calling thread or the
pool's workers); the same bits on every ISA copy (the baseline one is the scalar twin); the inputs it refuses. In the
model: GQA prompts and MLA's expanded prompts on kernel Linears take it, within float32 rounding of the torch path,
and a chunked prompt's attention is the whole prompt's, bit for bit."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from isa_copies import outputs_per_isa
from ktrun.models import attention
from ktrun.models.kv_cache import Batch, BlockLayout, BlockPool, SeqCache
from ktrun.ops import prompt_attention
from ktrun.ops.library import KernelError
from ktrun.ops.moe import MoEKernels

pytestmark = pytest.mark.skipif(prompt_attention._library() is None, reason="libktkernels not built")

# (n, nh, nkv, dk, dv, start, window, sinks): Qwen3-30B-A3B's heads; a chunk after a prefix; gpt-oss-like windowed
# heads with sinks; MQA; MHA with MiMo-like dk != dv; 6 and 16 query heads per kv head; one row; a window shorter
# than a row block; rows not a multiple of a pass
SHAPES = [(70, 32, 4, 128, 128, 0, None, False), (45, 32, 4, 128, 128, 37, None, False),
          (50, 8, 2, 64, 64, 20, 16, True), (33, 8, 1, 64, 64, 0, None, False), (40, 12, 12, 192, 128, 5, None, False),
          (29, 12, 2, 32, 48, 3, None, True), (21, 16, 1, 16, 16, 0, 3, False), (1, 8, 4, 64, 32, 9, None, False),
          (100, 4, 4, 48, 16, 0, 7, False)]


def _case(n, nh, nkv, dk, dv, start, sinks, seed, pad=0):
    """q (n, nh, dk) and out rows as views of wider rows (pad floats of gap), k / v (start + n, nkv, dk / dv)."""
    g = torch.Generator().manual_seed(seed)
    S = start + n
    q = torch.randn(n, nh, dk + pad, generator=g)[..., :dk] * 2
    k = torch.randn(S, nkv, dk, generator=g)
    v = torch.randn(S, nkv, dv, generator=g)
    return q, k, v, (torch.randn(nh, generator=g) if sinks else None)


def _reference(q, k, v, start, scale, window=None, sinks=None):
    """float64: softmax over the visible keys (and the sink logit) of q . k * scale, times v -> (n, nh, dv)."""
    n, nh, _ = q.shape
    S, nkv, _ = k.shape
    rep = nh // nkv
    kk = np.repeat(k.numpy().astype(np.float64), rep, axis=1)
    vv = np.repeat(v.numpy().astype(np.float64), rep, axis=1)
    s = np.einsum("thd,jhd->htj", q.numpy().astype(np.float64), kk) * scale
    pos = np.arange(n)[:, None] + start
    j = np.arange(S)[None]
    hidden = (j > pos) | ((j <= pos - window) if window else np.zeros_like(j > pos))
    s = np.where(hidden[None], -np.inf, s)
    if sinks is not None:
        s = np.concatenate([s, np.broadcast_to(sinks.numpy().astype(np.float64)[:, None, None], (nh, n, 1))], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True))[..., :S]
    return np.einsum("htj,jhd->thd", p, vv)


@pytest.fixture(scope="module")
def kernels():
    k = MoEKernels(n_threads=2)
    yield k
    k.close()


@pytest.mark.parametrize("n,nh,nkv,dk,dv,start,window,sinks", SHAPES)
def test_against_float64_reference(n, nh, nkv, dk, dv, start, window, sinks, kernels):
    q, k, v, sk = _case(n, nh, nkv, dk, dv, start, sinks, n + nh, pad=3)
    wide = torch.full((n, nh, dv + 5), float("nan"))
    out = wide[..., :dv]                                         # strided heads: only the (n, nh, dv) part written
    assert prompt_attention.attend(q, k, v, start, 0.09, out, window, sk, kernels=kernels)
    np.testing.assert_allclose(out.numpy(), _reference(q, k, v, start, 0.09, window, sk), rtol=1e-4, atol=1e-5)
    assert wide[..., dv:].isnan().all()


def test_mla_key_in_two_parts(kernels):
    """MLA's expanded form: a per-head key part (dn) strided inside kv_b's output and the roped part (dr) every head
    shares, read with head stride 0, as if the key were expanded per head."""
    g = torch.Generator().manual_seed(5)
    n, nh, dn, dr, dv, R = 50, 16, 32, 16, 32, 48
    kv = torch.randn(n, nh, dn + dv, generator=g)
    lat = torch.randn(n, R + dr, generator=g)
    q = torch.randn(n, nh, dn + dr, generator=g)
    out = torch.empty(n, nh, dv)
    assert prompt_attention.attend(q, kv[..., :dn], kv[..., dn:], 0, 0.2, out, k2=lat[:, None, R:], kernels=kernels)
    k_full = torch.cat([kv[..., :dn], lat[:, None, R:].expand(n, nh, dr)], dim=-1)
    np.testing.assert_allclose(out.numpy(), _reference(q, k_full, kv[..., dn:], 0, 0.2), rtol=1e-4, atol=1e-5)
    whole = torch.empty(n, nh, dv)                               # the same bits with the shared part per head
    assert prompt_attention.attend(q, kv[..., :dn], kv[..., dn:], 0, 0.2, whole,
                                   k2=lat[:, None, R:].expand(n, nh, dr).contiguous(), kernels=kernels)
    assert torch.equal(whole, out)


@pytest.mark.parametrize("window,sinks", [(None, False), (6, True)])
def test_a_rows_bits_are_its_own(window, sinks, kernels):
    """Rows of a whole prompt = the same rows as a chunk after its prefix = the same rows of a longer prompt, on the
    calling thread and on the pool: each row's result depends only on its query, keys and values."""
    n, nh, nkv, dk, dv = 90, 16, 2, 64, 64
    q, k, v, sk = _case(n, nh, nkv, dk, dv, 0, sinks, 11)
    whole = torch.empty(n, nh, dv)
    assert prompt_attention.attend(q, k, v, 0, 0.1, whole, window, sk, kernels=kernels)
    for ctx in (None, kernels):
        chunk = torch.empty(n - 37, nh, dv)
        assert prompt_attention.attend(q[37:], k, v, 37, 0.1, chunk, window, sk, kernels=ctx)
        assert torch.equal(chunk, whole[37:])
        short = torch.empty(23, nh, dv)
        assert prompt_attention.attend(q[:23], k[:23], v[:23], 0, 0.1, short, window, sk, kernels=ctx)
        assert torch.equal(short, whole[:23])


_DIGEST = """
import hashlib, sys, torch
sys.path.insert(0, {tests!r})
from test_kernels_prompt_attend import SHAPES, _case
from ktrun.ops import prompt_attention
h = hashlib.sha256()
for i, (n, nh, nkv, dk, dv, start, window, sinks) in enumerate(SHAPES):
    q, k, v, sk = _case(n, nh, nkv, dk, dv, start, sinks, i)
    out = torch.empty(n, nh, dv)
    assert prompt_attention.attend(q, k, v, start, 0.1, out, window, sk)
    h.update(out.numpy().tobytes())
print(h.hexdigest())
"""


def test_every_isa_copy_gives_the_same_bits():
    """The scalar twin (baseline copy), AVX2 and AVX-512 copies chosen by KT_KERNEL_BACKEND in fresh processes."""
    digests = outputs_per_isa(_DIGEST.format(tests=os.path.dirname(__file__)))
    assert len(digests) >= 2 and len(set(digests.values())) == 1, digests


def test_refused_inputs_leave_out_untouched(kernels):
    q, k, v, _ = _case(9, 8, 2, 32, 32, 0, False, 1)
    out = torch.zeros(9, 8, 32)
    assert not prompt_attention.attend(q.double(), k, v, 0, 0.1, out)                    # float32 only
    assert not prompt_attention.attend(q, k.to(torch.bfloat16), v, 0, 0.1, out)
    assert not prompt_attention.attend(q, k[:8], v[:8], 0, 0.1, out)                     # fewer keys than positions
    assert not prompt_attention.attend(q, k, v, 0, 0.1, out, sinks=torch.zeros(7))        # one sink per head
    assert not prompt_attention.attend(q[..., :24], k[..., :24], v[..., :24], 0, 0.1, out[..., :24])   # dv % 16
    assert not prompt_attention.attend(q, k[:, :1].expand(9, 3, 32), v, 0, 0.1, out)     # kv heads differ
    assert not out.any()
    with pytest.raises(KernelError, match="kt_prompt_attend: bad positions"):
        prompt_attention.attend(q, k, v, 0, 0.1, out, window=-2, kernels=kernels)        # refused by the library
    assert not out.any()


def _cache(nh, nkv, hd):
    pool = BlockPool(BlockLayout(1, ((nkv, hd), (nkv, hd)), 16), torch.float32, "cpu")
    return SimpleNamespace(sliding_window=None, softmax_scale=hd ** -0.5), pool


def test_gqa_prompts_take_the_kernel_within_rounding_of_torch(kernels):
    """gqa_attend with a kernel context: a 40-token prompt, then a 30-token chunk after it (a cached prefix of 3
    blocks), within float32 rounding of the torch path (no context: SDPA); the chunk's rows equal the rows of the
    same 70 tokens as one prompt, bit for bit."""
    nh, nkv, hd = 16, 4, 64
    cfg, pool = _cache(nh, nkv, hd)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(70, h, hd, generator=g) for h in (nh, nkv, nkv))

    def run(ctx, pieces):
        c, outs = SeqCache(pool, 128), []
        for a, b in pieces:
            batch = Batch.build([(c, list(range(a, b)))], "cpu")
            outs.append(attention.gqa_attend(cfg, q[a:b], k[a:b], v[a:b], batch, 0, kernels=ctx))
            batch.commit()
        c.release()
        return torch.cat(outs)

    chunked, whole = run(kernels, [(0, 40), (40, 70)]), run(kernels, [(0, 70)])
    assert torch.equal(chunked, whole)
    torch.testing.assert_close(chunked, run(None, [(0, 40), (40, 70)]), rtol=1e-5, atol=2e-6)


def test_mla_prompt_takes_the_kernel_within_rounding_of_torch(tmp_path_factory, monkeypatch):
    """The deepseek_v3 fixture with its Linears on the kernels: a 100-token prompt's MLA layers in the expanded form
    (forced: at the fixture's widths the absorbed one costs no more) take kt_prompt_attend (the roped key shared, not
    expanded). The first layer's attention (the same inputs either way) within float32 rounding of the torch form
    (_attend_causal_blocks); the logits close (the Linears quantize their input rows to int8, so a last-bit
    difference can move a row by a rounding step, and the later rows with it through the next layers' attention)."""
    from ktrun.engine import Engine
    from runtime_helpers import converted

    conv = converted(tmp_path_factory, "deepseek_v3", "bf16", gpu_method="rtn-int4", gpu_format="marlin",
                     gpu_group_size=64)
    eng = Engine(conv, ctx=256, use_kernels=False)
    monkeypatch.setattr(attention, "_naive_is_cheaper", lambda *a: True)
    ids = torch.randint(0, eng.model.cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    real_attend, real_blocks, outs = prompt_attention.attend, attention._attend_causal_blocks, []

    def attend(*a, **kw):
        assert kw.get("k2") is not None and real_attend(*a, **kw)
        outs.append(a[5].clone())                                            # out (n, nh, dv)
        return True

    def blocks(*a):
        outs.append(real_blocks(*a).transpose(0, 1))                         # (nh, n, dv) -> (n, nh, dv)
        return outs[-1].transpose(0, 1)

    def logits(on: bool) -> torch.Tensor:
        monkeypatch.setattr(prompt_attention, "attend", attend if on else lambda *a, **kw: False)
        monkeypatch.setattr(attention, "_attend_causal_blocks", blocks)
        return eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True).float()

    on = logits(True)
    n_layers = len(outs)
    off = logits(False)
    assert n_layers == len(outs) - n_layers >= 2
    torch.testing.assert_close(outs[0], outs[n_layers], rtol=1e-4, atol=1e-5)
    p, q = on.log_softmax(-1), off.log_softmax(-1)
    assert (p.exp() * (p - q)).sum(-1).mean() < 1e-3


@pytest.mark.parametrize("window", [None, 5])
def test_rows_with_sinks_take_the_kernel_at_any_count(window, kernels):
    """gpt-oss's sinks (kt_gqa_attend_batch has none): decode rows and a verify's rows take kt_prompt_attend too; a
    3-row verify equals three one-row steps bit for bit, within float32 rounding of the torch path."""
    nh, nkv, hd = 8, 2, 32
    cfg, pool = _cache(nh, nkv, hd)
    cfg.sliding_window = window
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(24, h, hd, generator=g) for h in (nh, nkv, nkv))
    sinks = torch.randn(nh, generator=g)

    def run(ctx, pieces):
        c, outs = SeqCache(pool, 64), []
        for a, b in pieces:
            batch = Batch.build([(c, list(range(a, b)))], "cpu")
            outs.append(attention.gqa_attend(cfg, q[a:b], k[a:b], v[a:b], batch, 0, sinks=sinks, kernels=ctx))
            batch.commit()
        c.release()
        return torch.cat(outs)

    verify = run(kernels, [(0, 21), (21, 24)])
    steps = run(kernels, [(0, 21), (21, 22), (22, 23), (23, 24)])
    assert torch.equal(verify, steps)
    torch.testing.assert_close(verify, run(None, [(0, 21), (21, 24)]), rtol=1e-5, atol=2e-6)
