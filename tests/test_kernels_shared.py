"""A shared expert inside the routed-expert job (kt_submit_shared / MoEKernels.submit(shared=...)): a one-expert
layer computed in the same job and added after the routed experts. With one sub-pool the result is, bit for bit, the
routed layer's own submit plus shared_weights times the shared layer's own submit (expert 0, weight 1), in float32;
on every backend (the int paths bit-identical to the scalar twin) and against the numpy reference."""
from __future__ import annotations

import numpy as np
import pytest
from ktrun.ops.library import KernelError
from ktrun.ops.moe import MoEKernels
from test_kernels_helpers import PackedLayer, assert_close, backend_params, routing

# (routed bits, group, scale dtype), (shared bits, group, intermediate): x shared between the parts (same K and
# groups) or quantized twice (other groups / bits / the bf16 layout), padded hidden and intermediate sizes
CASES = [((4, 64, "f16"), (4, 64, 128)),      # same x
         ((4, 32, "f32"), (8, -1, 80)),       # int8 per-row shared, padded intermediate
         ((8, 32, "f16"), (4, 64, 192)),
         ((16, -1, "f32"), (4, 32, 96))]      # bf16 routed layer, int shared expert
HIDDEN = 96


def _layers(rng, routed, shared, n_shards=1):
    (rb, rg, rs), (sb, sg, si) = routed, shared
    r = PackedLayer(rng, n_experts=6, hidden=HIDDEN, inter=80, bits=rb, group_size=rg, scale_dtype=rs,
                    n_shards=n_shards)
    s = PackedLayer(rng, n_experts=1, hidden=HIDDEN, inter=si, bits=sb, group_size=sg)
    return r, s


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("routed,shared", CASES)
def test_shared_in_job_is_routed_plus_shared_bitwise(backend, routed, shared):
    rng = np.random.default_rng(routed[0] * 10 + shared[0])
    r, s = _layers(rng, routed, shared)
    with MoEKernels(n_threads=2, backend=backend) as moe, MoEKernels(n_threads=1, backend="scalar") as ref:
        for m in (moe, ref):
            r.add_to(m, 0)
            s.add_to(m, 7)
        for T, k in [(1, 3), (5, 2), (37, 4)]:              # decode streams and prefill tiles
            x = rng.standard_normal((T, HIDDEN)).astype(np.float32)
            ids, w = routing(rng, T, k, r.E)
            sw = rng.random(T).astype(np.float32) + 0.5
            ones_ids, ones = np.zeros((T, 1), np.int64), np.ones((T, 1), np.float32)
            for weights in (None, sw):
                got = moe.forward(0, x, ids, w, shared=7, shared_weights=weights)
                y_s = moe.forward(7, x, ones_ids, ones)
                want = moe.forward(0, x, ids, w) + (y_s if weights is None else weights[:, None] * y_s)
                assert np.array_equal(got, want), f"{backend} T={T}: fused != routed + shared"
                twin = ref.forward(0, x, ids, w, shared=7, shared_weights=weights)
                if routed[0] == 16:   # the bf16 layout's dot products round per backend (test_kernels_numerics)
                    assert_close(got, twin, 1e-5, f"{backend} T={T} vs the scalar twin")
                else:
                    assert np.array_equal(got, twin), f"{backend} T={T}: != scalar twin"
                numpy = r.reference(x, ids, w) + (1.0 if weights is None else weights[:, None]) * \
                    s.reference(x, ones_ids, ones)
                assert_close(got, numpy, 2e-3 if routed[0] != 16 else 3e-3, f"{backend} T={T} vs numpy")


@pytest.mark.parametrize("backend", backend_params())
def test_shared_with_mask_accumulate_and_pools(backend):
    rng = np.random.default_rng(3)
    r, s = _layers(rng, (4, 64, "f16"), (4, 64, 128), n_shards=2)
    x = rng.standard_normal((6, HIDDEN)).astype(np.float32)
    ids, w = routing(rng, 6, 3, r.E)
    skip = np.zeros(r.E, np.uint8)
    skip[ids[0, 0]] = 1
    ones_ids, ones = np.zeros((6, 1), np.int64), np.ones((6, 1), np.float32)
    with MoEKernels(n_threads=2, backend=backend) as moe:
        r.add_to(moe, 0)
        s.add_to(moe, 1)
        routed, y_s = moe.forward(0, x, ids, w, skip=skip), moe.forward(1, x, ones_ids, ones)
        base = rng.standard_normal((6, HIDDEN)).astype(np.float32)
        out = base.copy()
        moe.submit(0, x, ids, w, out=out, accumulate=True, skip=skip, shared=1)
        moe.sync()
        # accumulate: out = base, then the routed experts, then the shared one, column by column
        assert_close(out, base + routed + y_s, 1e-6, f"{backend} accumulate + mask")
        assert np.array_equal(moe.forward(0, x, ids, w, skip=skip, shared=1), routed + y_s)
    with MoEKernels(n_threads=2, numa_pools=2, backend=backend) as moe:   # pools sum partials: same up to rounding
        r.add_to(moe, 0)
        s.add_to(moe, 1)
        assert_close(moe.forward(0, x, ids, w, shared=1),
                     moe.forward(0, x, ids, w) + moe.forward(1, x, ones_ids, ones), 1e-5, f"{backend} 2 pools")


def test_shared_layer_errors():
    rng = np.random.default_rng(4)
    r, s = _layers(rng, (4, 64, "f16"), (4, 64, 128))
    two = PackedLayer(rng, n_experts=2, hidden=HIDDEN, inter=64, bits=4, group_size=64)
    other = PackedLayer(rng, n_experts=1, hidden=64, inter=64, bits=4, group_size=64)
    x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
    ids, w = routing(rng, 2, 2, r.E)
    with MoEKernels(n_threads=2) as moe:
        r.add_to(moe, 0)
        two.add_to(moe, 1)
        other.add_to(moe, 2)
        with pytest.raises(KeyError, match="one expert"):
            moe.submit(0, x, ids, w, shared=1)
        with pytest.raises(KernelError, match="hidden size 96"):
            moe.forward(0, x, ids, w, shared=2)
        s.add_to(moe, 3)
        with pytest.raises(ValueError, match="shared_weights"):
            moe.forward(0, x, ids, w, shared=3, shared_weights=np.ones(3, np.float32))
