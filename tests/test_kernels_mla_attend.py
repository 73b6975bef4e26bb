"""kt_mla_attend (ABI 11; ktrun.ops.glue.mla_attend) and kt_mla_attend_batch (ABI 12: every request of a decode
step in one call): MLA's absorbed decode attention core (scores, softmax, latent
output of one query row per head) in one call. It is not torch's bits, so it is held to its own promise instead:
within float32 rounding of a float64 numpy reference; the same bits however the cache is split into runs, on the
calling thread or split over the pool's workers, and on every ISA copy (the baseline one is the scalar twin: a
subprocess per KT_KERNEL_BACKEND); the arguments the C side refuses; and in the model, the decode path that uses it
against the torch form it replaced."""
from __future__ import annotations

import ctypes
import hashlib
import os

import numpy as np
import pytest
import torch
from isa_copies import outputs_per_isa
from ktrun.ops import glue
from ktrun.ops.library import KernelError, load_library
from ktrun.ops.moe import MoEKernels

# (heads, R, dr, run lengths): DeepSeek-V3's decode shape, heads outside the 8-head tile, R not a multiple of the
# 128-column value pass, no rotary part, many runs (KV blocks), one position; caches longer than a chunk of positions
# (kt::kAttendChunk = 128: computed chunk by chunk and merged): the embedded default model's heads over 600 positions
# in runs that cross the chunks, one position past a chunk; the AVX-512 copy's 16-score tiles (8, 4 and 2 heads at 2,
# 4 and 8 positions, then single heads and positions): 6 = 4 + 2 heads over 10 positions, 2 heads over 17, 12 = 8 + 4
SHAPES = [(128, 512, 64, [33]), (13, 48, 16, [5, 7, 1]), (9, 160, 0, [4]), (24, 512, 64, [16, 16, 16, 3]),
          (3, 16, 16, [1]), (4, 64, 32, [100, 200, 300]), (16, 512, 64, [129]), (6, 32, 16, [7, 3]),
          (2, 48, 0, [17]), (12, 128, 0, [37])]


def _case(nh: int, R: int, dr: int, runs: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    S = sum(runs)
    pool = torch.randn(S + 2 * len(runs), R + dr + 5, generator=g) * 2   # runs are row views of a wider pool
    lats, o = [], 0
    for n in runs:
        lats.append(pool[o:o + n, :R + dr])
        o += n + 2
    q_lat = torch.randn(nh, R, generator=g)
    q_rot = torch.randn(nh, 2, max(dr, 1), generator=g)[:, 0, :dr]                      # strided heads
    return q_lat, q_rot, lats


def _reference(q_lat, q_rot, lats, scale):
    lat = np.concatenate([x.numpy() for x in lats]).astype(np.float64)
    R = q_lat.shape[1]
    s = (q_lat.numpy().astype(np.float64) @ lat[:, :R].T + q_rot.numpy().astype(np.float64) @ lat[:, R:].T) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ lat[:, :R]


@pytest.mark.parametrize("nh,R,dr,runs", SHAPES)
def test_against_float64_reference(nh, R, dr, runs):
    q_lat, q_rot, lats = _case(nh, R, dr, runs, nh + R)
    assert glue.mla_attend_supported(lats, R, nh)
    out = torch.full((nh, R), float("nan"))
    glue.mla_attend(q_lat, q_rot, lats, 0.07, out)
    np.testing.assert_allclose(out.numpy(), _reference(q_lat, q_rot, lats, 0.07), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("nh,R,dr,runs", SHAPES)
def test_same_bits_for_any_runs_and_threads(nh, R, dr, runs):
    q_lat, q_rot, lats = _case(nh, R, dr, runs, 3 * nh + R)
    one = torch.empty(nh, R)
    glue.mla_attend(q_lat, q_rot, [torch.cat(lats)], 0.1, one)
    split = torch.empty(nh, R)
    glue.mla_attend(q_lat, q_rot, lats, 0.1, split)
    assert torch.equal(one, split)
    with MoEKernels(n_threads=2) as k:
        pooled = torch.empty(nh, R)
        glue.mla_attend(q_lat, q_rot, lats, 0.1, pooled, k)
        assert torch.equal(one, pooled)
    heads = torch.empty(nh, R)   # a head's row does not depend on the other heads
    for h in range(nh):
        glue.mla_attend(q_lat[h:h + 1], q_rot[h:h + 1], lats, 0.1, heads[h:h + 1])
    assert torch.equal(one, heads)


@pytest.mark.parametrize("nh,R,dr", [(128, 512, 64), (13, 48, 16), (4, 64, 32), (9, 160, 0)])
def test_batch_gives_each_request_the_bits_it_gets_alone(nh, R, dr):
    """kt_mla_attend_batch (ABI 12): m requests of different lengths and block runs, their caches row views of one
    pool, in one call: every request's output equals its own kt_mla_attend call bit for bit, on the calling thread and
    on the pool; requests whose caches do not share a row stride are refused (False, nothing written)."""
    g = torch.Generator().manual_seed(nh + R)
    reqs = [[5, 7, 1], [33], [1], [16, 16, 3], [2, 2], [200, 100], [129]]   # the last two: 3 and 2 chunks
    pool = torch.randn(sum(map(sum, reqs)) + 64, R + dr + 3, generator=g)
    lats, o = [], 0
    for runs in reqs:
        lats.append([pool[o + 2 * i + sum(runs[:i]):o + 2 * i + sum(runs[:i + 1]), :R + dr]
                     for i in range(len(runs))])
        o += sum(runs) + 2 * len(runs)
    m = len(reqs)
    q_lat = torch.randn(m, nh, R, generator=g)
    q_rot = torch.randn(m, nh, 2, max(dr, 1), generator=g)[:, :, 0, :dr]                   # strided heads
    want = torch.empty(m, nh, R)
    for i in range(m):
        glue.mla_attend(q_lat[i], q_rot[i], lats[i], 0.1, want[i])
    got = torch.full((m, nh, R), float("nan"))
    assert glue.mla_attend_batch(q_lat, q_rot, lats, 0.1, got)
    assert torch.equal(got, want)
    with MoEKernels(n_threads=2) as k:
        pooled = torch.full((m, nh, R), float("nan"))
        assert glue.mla_attend_batch(q_lat, q_rot, lats, 0.1, pooled, k)
        assert torch.equal(pooled, want)
    other = torch.randn(4, R + dr + 1, generator=g)[:, :R + dr]                           # another row stride
    untouched = torch.zeros(2, nh, R)
    assert not glue.mla_attend_batch(q_lat[:2], q_rot[:2], [lats[0], [other]], 0.1, untouched)
    assert not untouched.any()


_DIGEST = """
import hashlib, sys, torch
sys.path.insert(0, {tests!r})
from test_kernels_mla_attend import SHAPES, _case
from ktrun.ops import glue
h = hashlib.sha256()
for i, (nh, R, dr, runs) in enumerate(SHAPES):
    q_lat, q_rot, lats = _case(nh, R, dr, runs, i)
    out = torch.empty(nh, R)
    glue.mla_attend(q_lat, q_rot, lats, 0.1, out)
    h.update(out.numpy().tobytes())
print(h.hexdigest())
"""


def test_every_isa_copy_gives_the_same_bits():
    """The scalar twin (baseline copy), AVX2 and AVX-512 copies chosen by KT_KERNEL_BACKEND in fresh processes."""
    digests = outputs_per_isa(_DIGEST.format(tests=os.path.dirname(__file__)))
    assert len(digests) >= 2 and len(set(digests.values())) == 1, digests
    h = hashlib.sha256()   # and this process's copy (the widest the CPU has)
    for i, (nh, R, dr, runs) in enumerate(SHAPES):
        q_lat, q_rot, lats = _case(nh, R, dr, runs, i)
        out = torch.empty(nh, R)
        glue.mla_attend(q_lat, q_rot, lats, 0.1, out)
        h.update(out.numpy().tobytes())
    assert h.hexdigest() == digests["scalar"]


def test_unsupported_inputs_and_bad_arguments():
    q_lat, q_rot, lats = _case(8, 64, 16, [4], 1)
    assert glue.mla_attend_supported(lats, 64, 8)
    assert not glue.mla_attend_supported([lats[0].double()], 64, 8)                 # float32 only
    assert not glue.mla_attend_supported([lats[0].to(torch.bfloat16)], 64, 8)
    assert not glue.mla_attend_supported(lats, 56, 8)                               # R, dr not multiples of 16
    assert not glue.mla_attend_supported([lats[0], lats[0][:2].clone()], 64, 8)     # two row strides
    long = [torch.zeros(glue.MLA_ATTEND_MAX_SCORES // 8 + 1, 80)]
    assert not glue.mla_attend_supported(long, 64, 8)                # a long context on the calling thread: torch's
    assert glue.mla_attend_supported(long, 64, 8, pooled=True)       # on a pool any length (chunks of the cache)
    with pytest.raises(KernelError, match="float32"):
        glue.mla_attend(q_lat, q_rot.double(), lats, 0.1, torch.empty(8, 64))
    lib = load_library()
    out = torch.empty(8, 64)
    for bad in ({"R": 40}, {"dr": 8}, {"row_stride": 70}, {"n": 0}):
        args = {"R": 64, "dr": 16, "row_stride": 85, "n": 1} | bad
        ptrs = (ctypes.c_void_p * 1)(lats[0].data_ptr())
        lens = (ctypes.c_int64 * 1)(4)
        rc = lib.kt_mla_attend(None, 8, args["R"], args["dr"], q_lat.data_ptr(), 64, q_rot.data_ptr(),
                               q_rot.stride(0), 0.1, args["n"], ptrs, lens, args["row_stride"], out.data_ptr(), 64)
        assert rc == -1, bad
    with pytest.raises(KernelError, match="kt_mla_attend"):
        glue.mla_attend(q_lat[:, :40], q_rot, lats, 0.1, out)
