"""16-bit expert scales (layout version 2: float16, bfloat16) and two-level scales (version 3, sub6) in every kernel
backend: the same float32 numbers as the scalar twin bit for bit, and as numpy on the ktlayouts dequantization;
float32 (version 1) files still run.

Reference: numpy's own float16 -> float32 conversion and ktlayouts' bf16 bit patterns (independent of the kernels'
conversions), through PackedLayer's reference of layouts/README.md."""
from __future__ import annotations

import numpy as np
import pytest
from ktlayouts.cpu_expert import MatrixGeometry, pack_scales, unpack_scales
from ktrun.ops.moe import MoEKernels
from test_kernels_helpers import PackedLayer, assert_close, backend_params, routing


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("scale_dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("bits,group,hidden,inter", [(4, 32, 96, 80), (8, 64, 100, 200), (4, -1, 96, 80),
                                                     (8, 128, 96, 80)])
def test_scale_dtypes_match_scalar_bit_for_bit_and_numpy(backend, scale_dtype, bits, group, hidden, inter):
    rng = np.random.default_rng(bits * 100 + hidden)
    layer = PackedLayer(rng, n_experts=6, hidden=hidden, inter=inter, bits=bits, group_size=group,
                        scale_dtype=scale_dtype)
    want = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32}[scale_dtype]
    assert layer.shards[0].gate_s.dtype == want and layer.shards[0].down_s.dtype == want
    with MoEKernels(n_threads=2, backend=backend) as moe, MoEKernels(n_threads=2, backend="scalar") as ref:
        layer.add_to(moe)
        layer.add_to(ref)
        for T, k in [(1, 2), (5, 3), (30, 4)]:               # decode (split chains) and prefill tiles
            x = rng.standard_normal((T, hidden)).astype(np.float32)
            ids, w = routing(rng, T, k, layer.E)
            got = moe.forward(0, x, ids, w)
            assert np.array_equal(got, ref.forward(0, x, ids, w)), f"{backend} != scalar, T={T}"
            assert_close(got, layer.reference(x, ids, w), 2e-3, f"{backend} vs numpy T={T}")


def test_scale_conversion_covers_subnormal_and_negative_float16():
    """Scales at the edges of float16 (subnormal, negative, the largest) reach the kernels exactly."""
    geom = MatrixGeometry(16, 64, 4, 32, scale_dtype="f16")
    vals = np.array([6.1e-5, -6.1e-5, 3e-7, -5.96e-8, 65504.0, -1.5, 2.0 ** -14, 0.0] * 4, np.float32)
    vals = vals.astype(np.float16).astype(np.float32).reshape(16, 2)
    packed = pack_scales(vals, geom)
    assert packed.dtype == np.float16 and np.array_equal(unpack_scales(packed, geom), vals)
    rng = np.random.default_rng(3)
    layer = PackedLayer(rng, n_experts=2, hidden=64, inter=64, bits=4, group_size=32, scale_dtype="f16")
    for name in ("gate_s", "up_s", "down_s"):
        a = getattr(layer.shards[0], name)
        a.reshape(-1)[: vals.size] = vals.reshape(-1).astype(np.float16)    # edge values into the real arrays
    _same_on_every_backend(layer, rng, 64)


def _same_on_every_backend(layer: PackedLayer, rng: np.random.Generator, hidden: int):
    """3 tokens through the scalar, AVX-512 and AVX2 backends this CPU has: bit-identical -> (x, ids, w, output)."""
    from ktrun.ops.library import backend_supported

    x = rng.standard_normal((3, hidden)).astype(np.float32)
    ids, w = routing(rng, 3, 2, layer.E)
    outs = []
    for backend in ("scalar", "avx512", "avx2"):
        if backend_supported(backend):
            with MoEKernels(n_threads=1, backend=backend) as moe:
                layer.add_to(moe)
                outs.append(moe.forward(0, x, ids, w))
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])
    return x, ids, w, outs[0]


def test_mixed_scale_dtypes_in_one_layer_are_refused():
    rng = np.random.default_rng(5)
    a = PackedLayer(rng, n_experts=2, hidden=64, inter=128, bits=4, group_size=32, n_shards=2, scale_dtype="f16")
    b = PackedLayer(rng, n_experts=2, hidden=64, inter=128, bits=4, group_size=32, n_shards=2, scale_dtype="f32")
    with MoEKernels(n_threads=1) as moe, pytest.raises(ValueError, match="share a dtype"):
        a.add_to(moe, shards=[a.shards[0], b.shards[1]])


# Two-level scales (sub6: int4 group 32, super-blocks of 256 K): hidden 96 / inter 80 pad to 256 (K and I), 512 / 512
# with 2 shards (pieces on 256-unit boundaries, and served on 2 pools); T from 1 to 512 (decode streams, 8-row tiles).
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("hidden,inter,n_shards,threads", [(96, 80, 1, 1), (512, 512, 2, 2), (256, 256, 1, 2)])
def test_two_level_scales_match_scalar_bit_for_bit_and_numpy(backend, hidden, inter, n_shards, threads):
    rng = np.random.default_rng(hidden + inter + n_shards)
    layer = PackedLayer(rng, n_experts=4, hidden=hidden, inter=inter, bits=4, group_size=32, n_shards=n_shards,
                        scale_dtype="sub6")
    assert layer.shards[0].gate_s.dtype == np.uint8 and layer.geoms[0][0].k_pad % 256 == 0
    cases = [(1, 1), (1, 4), (3, 2), (8, 4), (9, 2), (40, 3)] + ([(512, 2)] if hidden == 256 else [])
    with MoEKernels(n_threads=threads, numa_pools=n_shards, backend=backend) as moe, \
            MoEKernels(n_threads=threads, numa_pools=n_shards, backend="scalar") as ref:
        layer.add_to(moe)
        layer.add_to(ref)
        for T, k in cases:
            x = rng.standard_normal((T, hidden)).astype(np.float32)
            ids, w = routing(rng, T, k, layer.E)
            got = moe.forward(0, x, ids, w)
            if T <= 64 or backend != "scalar":
                assert np.array_equal(got, ref.forward(0, x, ids, w)), f"{backend} != scalar, T={T}"
            assert_close(got, layer.reference(x, ids, w), 2e-3, f"{backend} vs numpy T={T}")
            assert_close(got, layer.reference(x, ids, w, quantized=False), 0.1, f"{backend} vs float acts T={T}")


def test_two_level_records_at_the_edges_reach_every_backend_exactly():
    """Sub-scales -32 and 31, zero and negative super-scales, the smallest float16 (subnormal) super-scale: the
    kernels' decoding (AVX-512 vectors, AVX2 per group, the scalar formula) gives what ktlayouts unpacks."""
    from ktlayouts.cpu_expert import pack_two_level, unpack_codes, unpack_two_level
    rng = np.random.default_rng(9)
    layer = PackedLayer(rng, n_experts=2, hidden=256, inter=256, bits=4, group_size=32, scale_dtype="sub6")
    geom = layer.geoms[0][0]
    q = rng.integers(-32, 32, size=(geom.n_pad, geom.n_groups))
    q[:, 0], q[:, 1], q[0] = -32, 31, 0
    d = (rng.standard_normal((geom.n_pad, geom.n_groups // 8)) * 0.01).astype(np.float16).astype(np.float32)
    d[1], d[2, 0], d[3] = -0.004, 2.0 ** -24, 0.0
    rec = pack_two_level(d, q, geom)
    _, qq = unpack_two_level(rec)
    assert np.array_equal(qq.transpose(0, 2, 1).reshape(geom.n_pad, -1), q)
    for name in ("gate_s", "up_s"):
        getattr(layer.shards[0], name)[:] = rec
    x, ids, w, out = _same_on_every_backend(layer, rng, 256)
    scale = np.repeat(d[:, :, None] * q.reshape(geom.n_pad, -1, 8), 32, axis=2).reshape(geom.n_pad, -1)
    for p in ("gate", "up"):              # W = (code - 8) * d * q, from numpy's own float16 -> float32
        codes = np.stack([unpack_codes(c, geom) for c in getattr(layer.shards[0], p + "_q")]).astype(np.float64)
        layer.deq[0][p][:] = (codes - 8) * scale
    assert_close(out, layer.reference(x, ids, w), 2e-3, "edge records vs numpy")


def test_two_level_scales_need_int4_group_32_and_whole_super_blocks():
    from ktrun.ops.library import KernelError
    rng = np.random.default_rng(4)
    layer = PackedLayer(rng, n_experts=2, hidden=256, inter=256, bits=4, group_size=32, scale_dtype="sub6")
    with MoEKernels(n_threads=1) as moe:
        with pytest.raises((ValueError, KernelError), match="sub6|KT_SUB6|two-level"):
            moe.add_layer(0, shards=layer.shards, n_experts=2, hidden=256, intermediate_pad=256, bits=4, group_size=64,
                          scale_dtype="sub6")
        layer.add_to(moe)
