"""kt_gqa_attend_batch (ABI 15; ktrun.ops.glue.gqa_attend_batch): GQA / MQA attention of m query rows, each over its
own cache rows, in one call (one pool job). Not torch's bits, so held to its own promise: within float32 rounding of
a float64 numpy reference; the same bits however the cache is split into runs, whatever the other rows of the batch,
on the calling thread or over the pool's workers, and on every ISA copy (the baseline one is the scalar twin); the
inputs it refuses. In the model (ktrun.models.attention.gqa_attend): decode rows and a request's few new rows take it,
each row with the bits of its token decoded alone, sliding windows included, and agree with the torch path."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from isa_copies import outputs_per_isa
from ktrun.models import attention
from ktrun.models.kv_cache import Batch, BlockLayout, BlockPool, SeqCache
from ktrun.ops import glue
from ktrun.ops.moe import MoEKernels

# (query heads, kv heads, hd, vd, run lengths): Qwen3-30B-A3B, MQA, gpt-oss-like 64-dim heads over many runs,
# MiMo-like vd != hd, heads outside the 8-head tile, one position; caches longer than a chunk of positions
# (kt::kAttendChunk = 128: chunk by chunk, merged): Qwen3's heads over 257, runs crossing the chunks
SHAPES = [(32, 4, 128, 128, [33]), (8, 1, 64, 64, [5, 7, 1]), (64, 8, 64, 64, [16, 16, 16, 3]),
          (12, 4, 192, 128, [9, 2]), (3, 3, 16, 32, [1]), (32, 4, 128, 128, [257]), (8, 2, 64, 32, [150, 100, 350])]


def _case(nh, nkv, hd, vd, runs, seed, m=1):
    """m query rows over the same runs (row views of a wider pool, as KV blocks are): q (m, nh, hd), [(k, v)]."""
    g = torch.Generator().manual_seed(seed)
    S = sum(runs)
    kpool = torch.randn(S + 2 * len(runs), nkv, hd, generator=g)
    vpool = torch.randn(S + 2 * len(runs), nkv, vd, generator=g)
    out, o = [], 0
    for n in runs:
        out.append((kpool[o:o + n], vpool[o:o + n]))
        o += n + 2
    return torch.randn(m, nh, hd, generator=g) * 2, out


def _reference(q, runs, scale):
    k = np.concatenate([a.numpy() for a, _ in runs]).astype(np.float64)   # (S, nkv, hd)
    v = np.concatenate([b.numpy() for _, b in runs]).astype(np.float64)
    nh, nkv = q.shape[0], k.shape[1]
    out = []
    for h in range(nh):
        g = h // (nh // nkv)
        s = k[:, g] @ q[h].numpy().astype(np.float64) * scale
        p = np.exp(s - s.max())
        out.append((p / p.sum()) @ v[:, g])
    return np.stack(out)


@pytest.mark.parametrize("nh,nkv,hd,vd,runs", SHAPES)
def test_against_float64_reference(nh, nkv, hd, vd, runs):
    q, kv = _case(nh, nkv, hd, vd, runs, nh + hd)
    out = torch.full((1, nh, vd), float("nan"))
    assert glue.gqa_attend_batch(q, [kv], 0.09, out)
    np.testing.assert_allclose(out[0].numpy(), _reference(q[0], kv, 0.09), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("nh,nkv,hd,vd,runs", SHAPES)
def test_same_bits_for_any_runs_batch_and_threads(nh, nkv, hd, vd, runs):
    """Each row alone over its positions in one run (the calling thread) is the reference; then the three rows in one
    call (row 0 over a shorter prefix, rows 1 and 2 over the runs as split), on the calling thread and on the pool."""
    q, kv = _case(nh, nkv, hd, vd, runs, 3 * nh + hd, m=3)
    short = attention._window_runs(kv, 0, max(1, sum(runs) - 2))
    entries = [short, kv, kv]
    alone = torch.empty(3, nh, vd)
    for i, runs_i in enumerate(entries):
        whole = [(torch.cat([a for a, _ in runs_i]), torch.cat([b for _, b in runs_i]))]
        assert glue.gqa_attend_batch(q[i:i + 1], [whole], 0.1, alone[i:i + 1])
    heads = torch.empty(1, nh, vd)   # a kv head's query heads do not depend on the other kv heads' (MQA: all)
    assert glue.gqa_attend_batch(q[1:2], [kv], 0.1, heads)
    assert torch.equal(heads[0], alone[1])
    for kernels in (None, MoEKernels(n_threads=2)):
        got = torch.full((3, nh, vd), float("nan"))
        assert glue.gqa_attend_batch(q, entries, 0.1, got, kernels)
        assert torch.equal(got, alone)
        if kernels is not None:
            kernels.close()


_DIGEST = """
import hashlib, sys, torch
sys.path.insert(0, {tests!r})
from test_kernels_gqa_attend import SHAPES, _case
from ktrun.ops import glue
h = hashlib.sha256()
for i, (nh, nkv, hd, vd, runs) in enumerate(SHAPES):
    q, kv = _case(nh, nkv, hd, vd, runs, i)
    out = torch.empty(1, nh, vd)
    assert glue.gqa_attend_batch(q, [kv], 0.1, out)
    h.update(out.numpy().tobytes())
print(h.hexdigest())
"""


def test_every_isa_copy_gives_the_same_bits():
    """The scalar twin (baseline copy), AVX2 and AVX-512 copies chosen by KT_KERNEL_BACKEND in fresh processes."""
    digests = outputs_per_isa(_DIGEST.format(tests=os.path.dirname(__file__)))
    assert len(digests) >= 2 and len(set(digests.values())) == 1, digests


def test_refused_inputs_leave_out_untouched():
    q, kv = _case(8, 2, 64, 64, [4, 3], 1)
    out = torch.zeros(1, 8, 64)
    assert not glue.gqa_attend_batch(q.double(), [kv], 0.1, out)                        # float32 only
    assert not glue.gqa_attend_batch(q, [[(a.to(torch.bfloat16), b) for a, b in kv]], 0.1, out)
    assert not glue.gqa_attend_batch(q[..., :40], [[(a[..., :40], b) for a, b in kv]], 0.1, out)   # hd % 16
    other = torch.randn(6, 3, 2, 64)[:, 0]                                              # another row stride
    assert not glue.gqa_attend_batch(q, [[kv[0], (other[:3], other[3:])]], 0.1, out)
    assert not glue.gqa_attend_batch(q, [[]], 0.1, out)                                  # no position
    assert not out.any()


def _cache_model(nh, nkv, hd, window=None):
    cfg = SimpleNamespace(sliding_window=window, softmax_scale=hd ** -0.5)
    pool = BlockPool(BlockLayout(1, ((nkv, hd), (nkv, hd)), 4), torch.float32, "cpu")   # 4 positions per block
    return cfg, pool


@pytest.mark.parametrize("window", [None, 5])
def test_model_rows_on_the_kernel_have_the_bits_of_their_token_decoded_alone(window):
    """gqa_attend: a prompt of 9 tokens through torch (more than SERIAL_MAX_ROWS rows), then 3 new rows of one request
    (a speculative verify: the kernel, each row over its causal windowed prefix) equal, bit for bit, three decode
    steps of one row each on a copy; both within float32 rounding of the torch path's rows."""
    nh, nkv, hd = 8, 2, 32
    cfg, pool = _cache_model(nh, nkv, hd, window)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(12, h, hd, generator=g) for h in (nh, nkv, nkv))
    a, b = SeqCache(pool, 64), SeqCache(pool, 64)
    for c in (a, b):
        batch = Batch.build([(c, list(range(9)))], "cpu")
        attention.gqa_attend(cfg, q[:9], k[:9], v[:9], batch, 0)
        batch.commit()
    batch = Batch.build([(a, [9, 10, 11])], "cpu")
    verify = attention.gqa_attend(cfg, q[9:], k[9:], v[9:], batch, 0)
    batch.commit()
    steps = []
    for t in (9, 10, 11):
        batch = Batch.build([(b, [t])], "cpu")
        steps.append(attention.gqa_attend(cfg, q[t:t + 1], k[t:t + 1], v[t:t + 1], batch, 0))
        batch.commit()
    assert torch.equal(verify, torch.cat(steps))
    c = SeqCache(pool, 64)                                         # the torch path: all 12 rows in one prefill
    batch = Batch.build([(c, list(range(12)))], "cpu")
    torch_rows = attention.gqa_attend(cfg, q, k, v, batch, 0)[9:]
    torch.testing.assert_close(verify, torch_rows, rtol=1e-5, atol=1e-6)
