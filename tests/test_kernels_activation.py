"""gpt-oss's expert activation on the CPU kernels (kt_set_layer_activation / MoEKernels.set_activation): biases on
gate, up and down and the clamped SwiGLU h = (clamp(u) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit)), on
every backend (scalar twin included) against a numpy reference of the same math (the reference's order: biases
before the clamps, the down bias before the routing weight) and against the scalar backend."""
from __future__ import annotations

import numpy as np
import pytest
from ktrun.ops.library import KernelError, backend_supported
from ktrun.ops.moe import MoEKernels
from test_kernels_helpers import PackedLayer, assert_close, backend_params, routing

SHAPES = [(4, 32, 96, 96, 1), (8, 32, 96, 80, 1), (8, -1, 64, 64, 1), (16, -1, 64, 64, 1), (4, 64, 64, 256, 2)]
ALPHA, LIMIT = 1.702, 0.6      # a low limit: the clamps bite at these scales


def clamped_swiglu(g: np.ndarray, u: np.ndarray, alpha: float = ALPHA, limit: float = LIMIT,
                   kind: str = "swiglu_clamped") -> np.ndarray:
    """gpt-oss's (u + 1) g sigmoid(alpha g), or DeepSeek-V4's silu(g) u ("silu_clamped"), on the clamped g and u."""
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    if kind == "silu_clamped":
        return g / (1.0 + np.exp(-g)) * u
    return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))


def biases(rng, layer: PackedLayer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ip = layer.plan.intermediate_pad
    bg, bu = np.zeros((layer.E, ip), np.float32), np.zeros((layer.E, ip), np.float32)
    bg[:, :layer.I] = rng.standard_normal((layer.E, layer.I)) * 0.5
    bu[:, :layer.I] = rng.standard_normal((layer.E, layer.I)) * 0.5
    return bg, bu, (rng.standard_normal((layer.E, layer.H)) * 0.5).astype(np.float32)


def reference(layer: PackedLayer, x, ids, w, bg, bu, bd, kind: str = "swiglu_clamped") -> np.ndarray:
    """numpy, following layouts/README.md's activation quantization as PackedLayer.reference does, one pool."""
    out = np.zeros((x.shape[0], layer.H), np.float64)
    for s, ((gu, dn), deq) in enumerate(zip(layer.geoms, layer.deq)):
        i0, i1 = layer.plan.shard_range(s)
        xa = layer._act(x.astype(np.float32), gu)
        for e in np.unique(ids[ids >= 0]):
            t, j = np.nonzero(ids == e)
            g = (xa[t] @ deq["gate"][e].T).astype(np.float32) + bg[e, i0:i1]
            u = (xa[t] @ deq["up"][e].T).astype(np.float32) + bu[e, i0:i1]
            h = clamped_swiglu(g.astype(np.float64), u.astype(np.float64), kind=kind).astype(np.float32)
            y = layer._act(h, dn) @ deq["down"][e].T
            if s == 0:
                y = y + bd[e]
            np.add.at(out, t, w[t, j, None] * y)
    return out.astype(np.float32)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bits,group,hidden,inter,shards", SHAPES)
@pytest.mark.parametrize("pools", [1, 2])
def test_clamped_swiglu_with_biases_matches_numpy_and_scalar(backend, bits, group, hidden, inter, shards, pools):
    rng = np.random.default_rng(bits * 100 + shards * 10 + pools + inter)
    layer = PackedLayer(rng, n_experts=8, hidden=hidden, inter=inter, bits=bits, group_size=group, n_shards=shards)
    bg, bu, bd = biases(rng, layer)
    with MoEKernels(n_threads=2, numa_pools=pools, backend=backend) as moe, \
            MoEKernels(n_threads=1, numa_pools=1, backend="scalar") as scalar:
        for m in (moe, scalar):
            layer.add_to(m)
            m.set_activation(0, "swiglu_clamped", ALPHA, LIMIT, bg, bu, bd)
        for T, k in [(1, 4), (6, 3), (40, 2)]:            # decode streams and prefill tiles
            x = (rng.standard_normal((T, hidden)) * 2).astype(np.float32)
            ids, w = routing(rng, T, k, layer.E)
            got = moe.forward(0, x, ids, w)
            assert_close(got, scalar.forward(0, x, ids, w), 1e-5, f"{backend} T={T} vs scalar")
            if pools == 1:   # (two sub-pools quantize h per piece: the numpy reference models one pool)
                assert_close(got, reference(layer, x, ids, w, bg, bu, bd), 2e-3 if bits != 16 else 1e-4,
                             f"{backend} T={T} vs numpy")
            # the clamps are exercised: some g and u of this input lie beyond the limit
            g0 = x @ layer.deq[0]["gate"][ids[0, 0]].T + bg[ids[0, 0], :layer.plan.shard_range(0)[1]]
            assert (np.abs(g0) > LIMIT).any()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bits,group,hidden,inter,shards", [SHAPES[1], SHAPES[4]])
def test_deepseek_v4_clamped_silu_matches_numpy_and_scalar(backend, bits, group, hidden, inter, shards):
    """KT_ACT_SILU_CLAMPED (DeepSeek-V4's swiglu_limit, no biases): h = silu(min(g, L)) * clamp(u, -L, L)."""
    rng = np.random.default_rng(bits + inter)
    layer = PackedLayer(rng, n_experts=8, hidden=hidden, inter=inter, bits=bits, group_size=group, n_shards=shards)
    zero_g, zero_u = (np.zeros((layer.E, layer.plan.intermediate_pad), np.float32) for _ in range(2))
    zero_d = np.zeros((layer.E, hidden), np.float32)
    with MoEKernels(n_threads=2, backend=backend) as moe, MoEKernels(n_threads=1, backend="scalar") as scalar, \
            MoEKernels(n_threads=2, backend=backend) as plain:
        for m in (moe, scalar, plain):
            layer.add_to(m)
        for m in (moe, scalar):
            m.set_activation(0, "silu_clamped", limit=LIMIT)
        for T, k in [(1, 4), (40, 2)]:
            x = (rng.standard_normal((T, hidden)) * 2).astype(np.float32)
            ids, w = routing(rng, T, k, layer.E)
            got = moe.forward(0, x, ids, w)
            assert_close(got, scalar.forward(0, x, ids, w), 1e-5, f"{backend} T={T} vs scalar")
            assert_close(got, reference(layer, x, ids, w, zero_g, zero_u, zero_d, kind="silu_clamped"),
                         2e-3 if bits != 16 else 1e-4, f"{backend} T={T} vs numpy")
            assert np.abs(got - plain.forward(0, x, ids, w)).max() > 1e-2     # the clamps bind: not plain silu


@pytest.mark.parametrize("backend", backend_params())
def test_silu_without_biases_is_the_default_bitwise_and_down_bias_alone(backend):
    rng = np.random.default_rng(3)
    layer = PackedLayer(rng, n_experts=6, hidden=64, inter=128, bits=8, group_size=32)
    x = rng.standard_normal((7, 64)).astype(np.float32)
    ids, w = routing(rng, 7, 3, layer.E)
    with MoEKernels(n_threads=2, backend=backend) as moe:
        layer.add_to(moe)
        want = moe.forward(0, x, ids, w)
        moe.set_activation(0, "silu")
        assert np.array_equal(moe.forward(0, x, ids, w), want)
        bd = rng.standard_normal((layer.E, 64)).astype(np.float32)
        moe.set_activation(0, "silu", down_bias=bd)
        plus = (w[..., None] * bd[ids]).sum(axis=1)           # sum_j w_j * bd[e_j]
        assert_close(moe.forward(0, x, ids, w), want + plus, 1e-5, f"{backend} down bias")


def test_set_activation_rejects_bad_input():
    rng = np.random.default_rng(4)
    layer = PackedLayer(rng, n_experts=4, hidden=64, inter=64, bits=4, group_size=32)
    backend = "avx512" if backend_supported("avx512") else "scalar"
    with MoEKernels(n_threads=1, backend=backend) as moe:
        with pytest.raises(KeyError, match="layer 0 was not added"):
            moe.set_activation(0, "swiglu_clamped")
        layer.add_to(moe)
        with pytest.raises(ValueError, match="activation 'gelu' is not one of silu, swiglu_clamped"):
            moe.set_activation(0, "gelu")
        with pytest.raises(ValueError, match=r"gate_bias has shape \(4, 32\), expected \(4, 64\)"):
            moe.set_activation(0, "swiglu_clamped", gate_bias=np.zeros((4, 32)), up_bias=np.zeros((4, 64)))
        with pytest.raises(KernelError, match="gate and up biases come together"):
            moe.set_activation(0, "swiglu_clamped", gate_bias=np.zeros((4, 64)))
        with pytest.raises(KernelError, match="limit > 0"):
            moe.set_activation(0, "swiglu_clamped", limit=0.0)


# The default SiLU gate (silu_body.inc, 16 values at a time through exp16) on gate values far inside and outside
# exp's float range (|g| up to ~1e3: exp16's argument kept at most 88, libm's expf overflows there), 9 rows of
# 200 intermediate columns (a 16-value tail per row), digested per ISA copy
def _silu_case():
    rng = np.random.default_rng(7)
    layer = PackedLayer(rng, n_experts=4, hidden=64, inter=200, bits=8, group_size=32)
    x = (rng.standard_normal((9, 64)) * 300).astype(np.float32)
    ids, w = routing(rng, 9, 2, layer.E)
    return layer, x, ids, w


_SILU_DIGEST = """
import hashlib, sys
sys.path.insert(0, {tests!r})
from test_kernels_activation import _silu_case
from ktrun.ops.moe import MoEKernels
layer, x, ids, w = _silu_case()
with MoEKernels(n_threads=2) as moe:
    layer.add_to(moe)
    print(hashlib.sha256(moe.forward(0, x, ids, w).tobytes()).hexdigest())
"""


def test_silu_gate_same_bits_on_every_isa_copy_and_close_to_numpy():
    import os

    from isa_copies import outputs_per_isa

    digests = outputs_per_isa(_SILU_DIGEST.format(tests=os.path.dirname(os.path.abspath(__file__))))
    assert len(digests) >= 2 and len(set(digests.values())) == 1, digests
    layer, x, ids, w = _silu_case()
    with MoEKernels(n_threads=2) as moe:
        layer.add_to(moe)
        got = moe.forward(0, x, ids, w)
    g = np.concatenate([x.astype(np.float64) @ layer.deq[0]["gate"][e].T for e in range(layer.E)])
    assert np.abs(g).max() > 100            # the inputs reach past exp's range, both ways
    assert np.isfinite(got).all()
    with np.errstate(over="ignore"):        # the reference's exp(-g) overflows to inf for g < -709: silu -0
        want = layer.reference(x, ids, w)
    assert_close(got, want, 2e-3, "silu gate vs numpy (quantized acts)")
