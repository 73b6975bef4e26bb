"""The expert mask of the CPU kernels (kt_submit_masked / MoEKernels.submit(skip=...)): experts marked GPU-resident
are left out exactly as ids of -1 would be, bit for bit, on every backend (scalar twin included); the mask is read
during submit only, so flipping it while a job runs changes nothing in that job."""
from __future__ import annotations

import numpy as np
import pytest
from ktrun.ops.moe import MoEKernels
from test_kernels_helpers import PackedLayer, assert_close, backend_params, routing

# (bits, group size, hidden, intermediate, n_shards): int4 / int8 / bf16, padded shapes, two NUMA shards
SHAPES = [(4, 32, 96, 80, 1), (8, -1, 96, 80, 1), (16, -1, 64, 64, 1), (4, 64, 64, 256, 2)]


def _cut(ids: np.ndarray, skip: np.ndarray) -> np.ndarray:
    """ids with every skipped expert replaced by -1 (what the mask must be equivalent to)."""
    out = ids.copy()
    out[skip[ids].astype(bool)] = -1
    return out


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bits,group,hidden,inter,shards", SHAPES)
@pytest.mark.parametrize("pools", [1, 2])
def test_mask_is_ids_minus_one_bitwise(backend, bits, group, hidden, inter, shards, pools):
    rng = np.random.default_rng(bits * 100 + shards * 10 + pools)
    layer = PackedLayer(rng, n_experts=8, hidden=hidden, inter=inter, bits=bits, group_size=group, n_shards=shards)
    with MoEKernels(n_threads=2, numa_pools=pools, backend=backend) as moe:
        assert moe.backend == backend
        layer.add_to(moe)
        for T, k in [(1, 4), (6, 3), (40, 6)]:            # decode streams and prefill tiles
            x = rng.standard_normal((T, hidden)).astype(np.float32)
            ids, w = routing(rng, T, k, layer.E)
            skip = (rng.random(layer.E) < 0.4).astype(np.uint8)
            skip[ids[0, 0]] = 1                                # at least one routed expert is skipped
            got = moe.forward(0, x, ids, w, skip=skip)
            want = moe.forward(0, x, _cut(ids, skip), w)
            assert np.array_equal(got, want), f"{backend} T={T}: masked != ids set to -1"
            # the complement computes the rest: both halves add up to the unmasked layer (float sum order aside)
            rest = moe.forward(0, x, ids, w, skip=(1 - skip).astype(np.uint8))
            assert_close(got + rest, moe.forward(0, x, ids, w), 1e-5, f"{backend} T={T} mask + complement")
            if pools == 1:   # (two sub-pools quantize h per piece: the numpy reference models one pool)
                assert_close(got, layer.reference(x, _cut(ids, skip), w), 2e-3 if bits != 16 else 1e-4,
                             f"{backend} T={T} masked vs numpy")
            # no mask and an all-zero mask are the old call, bit for bit
            assert np.array_equal(moe.forward(0, x, ids, w, skip=np.zeros(layer.E, np.uint8)),
                                  moe.forward(0, x, ids, w))


@pytest.mark.parametrize("backend", backend_params())
def test_mask_skipping_everything_and_accumulate(backend):
    rng = np.random.default_rng(5)
    layer = PackedLayer(rng, n_experts=6, hidden=64, inter=64, bits=4, group_size=64)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    ids, w = routing(rng, 5, 3, layer.E)
    with MoEKernels(n_threads=2, backend=backend) as moe:
        layer.add_to(moe)
        assert not moe.forward(0, x, ids, w, skip=np.ones(layer.E, np.uint8)).any()
        base = rng.standard_normal((5, 64)).astype(np.float32)
        out = base.copy()
        moe.forward(0, x, ids, w, out=out, accumulate=True, skip=np.ones(layer.E, np.uint8))
        assert np.array_equal(out, base)                  # nothing routed here: out untouched
        skip = np.array([1, 0, 1, 0, 0, 0], np.uint8)
        out = base.copy()
        moe.forward(0, x, ids, w, out=out, accumulate=True, skip=skip)
        assert_close(out, base + moe.forward(0, x, _cut(ids, skip), w), 1e-6, "accumulate with a mask")


@pytest.mark.parametrize("backend", backend_params())
def test_mask_flipped_while_the_job_runs_changes_nothing(backend):
    """submit() reads the mask before it returns: the caller flips it for the next step at once."""
    rng = np.random.default_rng(9)
    layer = PackedLayer(rng, n_experts=8, hidden=96, inter=128, bits=8, group_size=32)
    x = rng.standard_normal((32, 96)).astype(np.float32)
    ids, w = routing(rng, 32, 4, layer.E)
    skip = np.array([1, 1, 0, 0, 1, 0, 0, 0], np.uint8)
    with MoEKernels(n_threads=2, backend=backend) as moe:
        layer.add_to(moe)
        want = moe.forward(0, x, _cut(ids, skip), w)
        out = moe.submit(0, x, ids, w, skip=skip)
        skip[:] = 1 - skip                                 # flipped while the workers compute
        moe.sync()
        assert np.array_equal(out, want)


def test_mask_errors_name_the_argument():
    rng = np.random.default_rng(1)
    layer = PackedLayer(rng, n_experts=4, hidden=64, inter=64, bits=4, group_size=64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    ids, w = routing(rng, 2, 2, layer.E)
    with MoEKernels(n_threads=1) as moe:
        layer.add_to(moe)
        for bad in (np.zeros(5, np.uint8), np.zeros(4, np.int32), [0, 0, 0, 0], np.zeros(8, np.uint8)[::2]):
            with pytest.raises(ValueError, match="skip"):
                moe.forward(0, x, ids, w, skip=bad)
