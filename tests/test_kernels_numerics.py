"""libktkernels numerics: every backend of this CPU against the scalar reference backend and against numpy on
ktlayouts-dequantized weights (int4, int8, bf16; group sizes 32/64/128/per-row; padded shapes; T 1..512; k 1..8)."""
from __future__ import annotations

import numpy as np
import pytest
from ktrun.ops.moe import MoEKernels
from test_kernels_helpers import PackedLayer, assert_close, backend_params, routing

# (bits, group size, hidden, intermediate): hidden 96 / 100 and intermediate 80 / 200 are padded by the layouts.
SHAPES = [(4, 32, 96, 80), (4, 64, 96, 80), (4, 128, 96, 80), (4, -1, 96, 80),
          (8, 32, 96, 80), (8, 64, 64, 128), (8, 128, 96, 80), (8, -1, 96, 80), (8, 64, 100, 200)]


@pytest.fixture(scope="module")
def scalar():
    with MoEKernels(n_threads=2, backend="scalar") as moe:
        yield moe


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bits,group,hidden,inter", SHAPES)
def test_int_layouts_match_scalar_and_numpy(backend, bits, group, hidden, inter, scalar):
    rng = np.random.default_rng(bits * 1000 + group + 7)
    layer = PackedLayer(rng, n_experts=10, hidden=hidden, inter=inter, bits=bits, group_size=group)
    with MoEKernels(n_threads=2, backend=backend) as moe:
        assert moe.backend == backend
        layer.add_to(moe)
        layer.add_to(scalar, layer_id=hash((bits, group)) % 1000)
        for T, k in [(1, 1), (1, 8), (3, 2), (9, 8), (17, 3), (40, 5)]:   # decode (<= 8 rows/expert) and prefill
            x = rng.standard_normal((T, hidden)).astype(np.float32)
            ids, w = routing(rng, T, k, layer.E)
            got = moe.forward(0, x, ids, w)
            ref = scalar.forward(hash((bits, group)) % 1000, x, ids, w)
            assert_close(got, ref, 1e-5, f"{backend} vs scalar T={T} k={k}")
            assert_close(got, layer.reference(x, ids, w), 2e-3, f"{backend} vs numpy (quantized acts) T={T} k={k}")
            assert_close(got, layer.reference(x, ids, w, quantized=False), 0.1 if bits == 4 else 0.05,
                         f"{backend} vs numpy (float acts) T={T} k={k}")


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bits", [4, 8])
def test_512_tokens_top8(backend, bits):
    rng = np.random.default_rng(512 + bits)
    layer = PackedLayer(rng, n_experts=8, hidden=64, inter=64, bits=bits, group_size=32)
    x = rng.standard_normal((512, 64)).astype(np.float32)
    ids, w = routing(rng, 512, 8, layer.E)
    with MoEKernels(n_threads=2, backend=backend) as moe:
        layer.add_to(moe)
        assert_close(moe.forward(0, x, ids, w), layer.reference(x, ids, w), 2e-3, f"{backend} T=512 k=8")


@pytest.mark.parametrize("backend", backend_params())
def test_bf16_layout(backend, scalar):
    rng = np.random.default_rng(16)
    layer = PackedLayer(rng, n_experts=6, hidden=96, inter=80, bits=16, group_size=-1)
    layer.add_to(scalar, layer_id=16)
    with MoEKernels(n_threads=2, backend=backend) as moe:
        layer.add_to(moe)
        for T, k in [(1, 2), (5, 6), (30, 3)]:
            x = rng.standard_normal((T, 96)).astype(np.float32)
            ids, w = routing(rng, T, k, layer.E)
            got = moe.forward(0, x, ids, w)
            assert_close(got, scalar.forward(16, x, ids, w), 1e-4, f"{backend} bf16 vs scalar")
            assert_close(got, layer.reference(x, ids, w), 1e-4, f"{backend} bf16 vs numpy")


@pytest.mark.parametrize("backend", backend_params())
def test_out_of_order_repeated_and_skipped_ids(backend):
    """The same expert twice for one token counts twice; order inside a row does not matter; id -1 is skipped."""
    rng = np.random.default_rng(3)
    layer = PackedLayer(rng, n_experts=5, hidden=64, inter=64, bits=4, group_size=64)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    ids = np.array([[4, 0, 4], [2, 2, 2], [3, -1, 1], [1, 0, 3]])
    w = rng.random((4, 3)).astype(np.float32)
    with MoEKernels(n_threads=2, backend=backend) as moe:
        layer.add_to(moe)
        got = moe.forward(0, x, ids, w)
        assert_close(got, layer.reference(x, ids, w), 2e-3, "repeated ids")
        perm = moe.forward(0, x, ids[:, ::-1].copy(), w[:, ::-1].copy())
        np.testing.assert_allclose(perm, got, rtol=1e-5, atol=1e-6 * np.abs(got).max())


def test_no_tokens_and_no_routes():
    rng = np.random.default_rng(0)
    layer = PackedLayer(rng, n_experts=3, hidden=64, inter=64, bits=8, group_size=64)
    with MoEKernels(n_threads=2) as moe:
        layer.add_to(moe)
        assert moe.forward(0, np.zeros((0, 64), np.float32), np.zeros((0, 2)), np.zeros((0, 2), np.float32)).shape == (0, 64)
        out = np.full((2, 64), 5.0, np.float32)
        moe.forward(0, np.ones((2, 64), np.float32), -np.ones((2, 2)), np.ones((2, 2), np.float32), out)
        assert not out.any(), "tokens without experts get zeros (no accumulate)"


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("group", [32, 64, -1])
def test_int4_extreme_codes_and_activations_equal_scalar(backend, group):
    """int4 codes at 0 / 15 and activations at +-127 over a long K (per-row: one 8192-deep group), 1-3 rows (the
    decode body's split chains, high nibbles multiplied in place as 16 x their codes) and 9 rows: bit for bit
    the scalar twin, and all-15 codes give the exact 7 * 127 * K."""
    from ktrun.ops.linear import LinearKernels
    rng = np.random.default_rng(15)
    n, k = 32, 8192
    codes = np.where(rng.random((k, n)) < 0.5, 0, 15).astype(np.uint8)
    codes[:, 0] = 15
    xs = {m: np.where(rng.random((m, k)) < 0.5, -1.0, 1.0).astype(np.float32) for m in (1, 2, 3, 9)}
    for x in xs.values():
        x[0] = 1.0
    outs = {}
    for b in ("scalar", backend):
        with LinearKernels(n_threads=2, backend=b) as lin:
            q, s = lin.repack(codes, np.ones((1 if group == -1 else k // group, n), np.float16), 4, group,
                              scale_dtype="f16")
            lin.add(0, q, s, n=n, k=k, bits=4, group_size=group)
            outs[b] = {m: lin.forward(0, x) for m, x in xs.items()}
    for m in xs:
        assert np.array_equal(outs[backend][m], outs["scalar"][m]), f"{backend} m={m} group={group}"
        assert outs[backend][m][0, 0] == np.float32(7 * k), f"{backend} m={m}: all-15 codes, x = 1"
