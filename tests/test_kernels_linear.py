"""libktkernels' dense Linear op (ktrun.ops.linear) and the GPU-code repack.

Numerics, for every backend of this CPU, group size 32/64/128/per-row, padded shapes and T in {1, 2, 7, 16, 64, 129,
512}: bit-identical to the scalar reference backend; equal (to float rounding) to numpy on ktlayouts' dequantized
weights with the README's int8 activation quantization; and within the exact bound of that quantization of a float64
matmul with the float activations: |y - x W^T| <= sum_g a_s[g]/2 * sum_{k in g} |W[n,k]| (rounding to the nearest
int8 level moves each activation by at most half its group's step a_s).
Repack: the C++ kt_linear_repack equals ktlayouts.cpu_linear.repack_gpu_codes byte for byte, from every GPU
container (gptq / compressed-tensors words as stored, (K, N) and (N, K) bytes, Marlin codes), and runs the real
GPU formats' weights (ktlayouts.gpu_formats dequantization as the reference)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from golden_data import GOLDEN, linear_entries
from ktlayouts.compressed_tensors import ct_pack
from ktlayouts.cpu_expert import quantize_activations
from ktlayouts.cpu_linear import (
    linear_geometry,
    pack_linear,
    repack_gpu_codes,
    to_gpu_codes,
    unpack_linear,
    unpack_linear_codes,
)
from ktlayouts.gptq import GptqGeometry, dequantize_kn, gptq_pack
from ktlayouts.gpu_formats import dequantize_linear
from ktlayouts.marlin import marlin_pack, marlin_unpack
from ktrun.ops.library import KernelError
from ktrun.ops.linear import LinearKernels
from ktrun.ops.moe import MoEKernels
from test_kernels_helpers import PackedLayer, assert_close, backend_params, routing

GOLDEN_LINEARS = linear_entries()
TOKENS = (1, 2, 7, 16, 64, 129, 512)
# (group, N, K): N never a multiple of 16 (partial last column block); K not a multiple of the group unit lcm(64, G)
# (K_pad > K) except where K % G is the only constraint left (G = 64, 128: K % G != 0 pads the last group)
SHAPES = {32: (72, 96), 64: (100, 160), 128: (40, 200), -1: (72, 100)}


def quantized_reference(x: np.ndarray, w: np.ndarray, geom) -> tuple[np.ndarray, np.ndarray]:
    """-> (numpy y on the int8-quantized activations, the bound on |y_kernel - x W^T| that quantization allows)."""
    a_q, a_s = quantize_activations(x, geom)
    xa = (a_q.reshape(len(x), geom.n_groups, geom.group) * a_s[..., None].astype(np.float64)).reshape(len(x), -1)
    wp = np.zeros((geom.n, geom.k_pad))
    wp[:, : geom.k] = np.abs(w)
    w_abs_groups = wp.reshape(geom.n, geom.n_groups, geom.group).sum(axis=2)          # (N, n_groups)
    bound = 0.5 * a_s.astype(np.float64) @ w_abs_groups.T                           # (T, N)
    return xa[:, : geom.k] @ w.T, bound


@pytest.fixture(scope="module")
def scalar():
    with LinearKernels(n_threads=2, backend="scalar") as lin:
        yield lin


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_linear_matches_scalar_and_numpy(backend, bits, group, scalar):
    n, k = SHAPES[group]
    rng = np.random.default_rng(bits * 100 + group + 1)
    geom = linear_geometry(n, k, bits, group)
    qw, sc = pack_linear((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), geom)
    w = unpack_linear(qw, sc, geom).astype(np.float64)
    scalar.add(bits * 1000 + group, qw, sc, n, k, bits, group)
    with LinearKernels(n_threads=2, backend=backend) as lin:
        assert lin.backend == backend
        lin.add(0, qw, sc, n, k, bits, group)
        for T in TOKENS:
            x = rng.standard_normal((T, k)).astype(np.float32) * rng.uniform(0.1, 3.0, size=(T, 1)).astype(np.float32)
            got = lin.forward(0, x)
            assert got.shape == (T, n) and got.dtype == np.float32
            np.testing.assert_array_equal(got, scalar.forward(bits * 1000 + group, x), err_msg=f"{backend} T={T}")
            ref_q, bound = quantized_reference(x, w, geom)
            assert_close(got, ref_q, 1e-5, f"{backend} vs numpy (quantized activations) T={T}")
            exact = x.astype(np.float64) @ w.T
            slack = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)                 # float32 accumulation
            excess = np.abs(got - exact) - (bound + slack)
            assert excess.max() <= 0, f"{backend} T={T}: beyond the activation-quantization bound by {excess.max():.3g}"


@pytest.mark.parametrize("backend", backend_params())
def test_fused_linears_and_output_views(backend):
    """Two Linears sharing x in one submission (q_a + kv_a, gate + up) give what each gives alone, written into
    column slices of one wide output without touching the columns between them."""
    rng = np.random.default_rng(5)
    k = 192
    geoms = [linear_geometry(n, k, 4, 64) for n in (72, 48, 130)]
    packed = [pack_linear(rng.standard_normal((g.n, k)).astype(np.float32), g) for g in geoms]
    with LinearKernels(n_threads=2, backend=backend) as lin:
        for i, (g, (q, s)) in enumerate(zip(geoms, packed)):
            lin.add(i, q, s, g.n, k, 4, 64)
        for T in (1, 5, 40):
            x = rng.standard_normal((T, k)).astype(np.float32)
            alone = [lin.forward(i, x) for i in range(3)]
            wide = np.full((T, 72 + 1 + 48 + 1 + 130), 7.0, np.float32)
            views = [wide[:, :72], wide[:, 73:121], wide[:, 122:]]
            got = lin.forward([0, 1, 2], x, out=views)
            for a, b, v in zip(alone, got, views):
                np.testing.assert_array_equal(a, b)
                assert b is v
            assert (wide[:, 72] == 7.0).all() and (wide[:, 121] == 7.0).all()
            # allocated outputs, as a list
            for a, b in zip(alone, lin.forward([0, 1, 2], x)):
                np.testing.assert_array_equal(a, b)


def test_async_api_torch_inputs_and_moe_on_one_pool():
    rng = np.random.default_rng(9)
    k, n = 96, 80
    geom = linear_geometry(n, k, 8, 32)
    q, s = pack_linear(rng.standard_normal((n, k)).astype(np.float32), geom)
    layer = PackedLayer(rng, n_experts=4, hidden=k, inter=64, bits=4, group_size=32)
    with MoEKernels(n_threads=2) as moe:
        lin = LinearKernels(moe)               # the MoE context's pool and backend
        assert lin.backend == moe.backend and lin.n_threads == 2
        lin.add(3, q, s, n, k, 8, 32)
        layer.add_to(moe)
        x = torch.randn(6, k)
        ref = lin.forward(3, x.numpy())
        # submit returns the output at once; it is complete after sync
        out = torch.zeros(6, n)
        assert lin.submit(3, x, out) is out
        _ = torch.randn(64, 64) @ torch.randn(64, 64)    # torch work meanwhile
        lin.sync()
        np.testing.assert_array_equal(out.numpy(), ref)
        # a Linear and a MoE layer in flight one after the other on the same pool
        ids, w = routing(rng, 6, 2, layer.E)
        moe_ref = moe.forward(0, x.numpy(), ids, w)
        a = lin.submit(3, x.numpy())
        m = moe.submit(0, x.numpy(), ids, w)             # waits for the Linear job, then runs
        b = lin.submit(3, x.numpy() * 2)                 # waits for the MoE job
        lin.sync()
        moe.sync()
        np.testing.assert_array_equal(a, ref)
        np.testing.assert_array_equal(m, moe_ref)
        np.testing.assert_array_equal(b, lin.forward(3, x.numpy() * 2))
        # bf16 activations (torch bfloat16 or numpy uint16 bit patterns) are converted exactly
        xb = x.to(torch.bfloat16)
        got = lin.forward(3, xb)
        np.testing.assert_array_equal(got, lin.forward(3, xb.float().numpy()))
        np.testing.assert_array_equal(got, lin.forward(3, xb.view(torch.int16).numpy().view(np.uint16)))
        # strided rows of x (a view into a wider buffer), and no tokens at all
        wide = np.zeros((6, k + 32), np.float32)
        wide[:, :k] = x.numpy()
        np.testing.assert_array_equal(lin.forward(3, wide[:, :k]), ref)
        assert lin.forward(3, np.zeros((0, k), np.float32)).shape == (0, n)
        # weights as CPU torch tensors, read in place
        lin.add(4, torch.from_numpy(q), torch.from_numpy(s), n, k, 8, 32)
        np.testing.assert_array_equal(lin.forward(4, x), ref)


def test_weights_are_read_in_place_from_a_mapped_file(tmp_path):
    """Registered tensors are not copied: rewriting the mapped file changes what the next call computes."""
    rng = np.random.default_rng(12)
    geom = linear_geometry(48, 128, 4, 64)
    (q1, s1), (q2, s2) = (pack_linear(rng.standard_normal((48, 128)).astype(np.float32), geom) for _ in range(2))
    path = tmp_path / "w.bin"
    path.write_bytes(q1.tobytes() + s1.tobytes())
    q_map = np.memmap(path, np.uint8, "r", 0, geom.qweight_shape)
    s_map = np.memmap(path, np.float32, "r", q1.nbytes, geom.scales_shape)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    with LinearKernels(n_threads=2) as lin:
        lin.add(0, q_map, s_map, 48, 128, 4, 64)
        lin.add(1, q2, s2, 48, 128, 4, 64)
        y1 = lin.forward(0, x)
        writer = np.memmap(path, np.uint8, "r+")
        writer[:] = np.frombuffer(q2.tobytes() + s2.tobytes(), np.uint8)
        writer.flush()
        np.testing.assert_array_equal(lin.forward(0, x), lin.forward(1, x))
        assert not np.array_equal(y1, lin.forward(0, x))


def test_bad_input_is_reported():
    rng = np.random.default_rng(2)
    g1, g2 = linear_geometry(40, 64, 4, 32), linear_geometry(40, 128, 4, 32)
    with LinearKernels(n_threads=2) as lin:
        lin.add(0, *pack_linear(rng.standard_normal((40, 64)).astype(np.float32), g1), 40, 64, 4, 32)
        lin.add(1, *pack_linear(rng.standard_normal((40, 128)).astype(np.float32), g2), 40, 128, 4, 32)
        with pytest.raises(KeyError, match="linear 7 was not added"):
            lin.forward(7, np.zeros((1, 64), np.float32))
        with pytest.raises(ValueError, match=r"expected \(T, 64\)"):
            lin.forward(0, np.zeros((1, 65), np.float32))
        with pytest.raises(KernelError, match="same K and group size"):
            lin.forward([0, 1], np.zeros((1, 64), np.float32))
        with pytest.raises(ValueError, match=r"expected float32 \(2, 40\)"):
            lin.forward(0, np.zeros((2, 64), np.float32), out=np.zeros((2, 41), np.float32))
        q, s = pack_linear(np.ones((40, 64), np.float32), g1)
        with pytest.raises(ValueError, match="qweight: uint8"):
            lin.add(2, q[:1], s, 40, 64, 4, 32)
        with pytest.raises(ValueError, match="scales: float64"):
            lin.add(2, q, s.astype(np.float64), 40, 64, 4, 32)
        with pytest.raises(ValueError, match="bits"):
            lin.add(2, q, s, 40, 64, 16, 32)
        codes = np.full((64, 40), 8, np.uint8)
        s16 = np.ones((2, 40), np.float16)
        codes[3, 5] = 16
        with pytest.raises(KernelError, match="int4 codes must be in 0..15"):
            lin.repack(codes, s16, 4, 32)
        with pytest.raises(KernelError, match="not a multiple of the group size"):
            lin.repack(np.zeros((96, 40), np.uint8), np.ones((2, 40), np.float16), 4, 64)
        with pytest.raises(ValueError, match="expected float16"):
            lin.repack(np.zeros((64, 40), np.uint8), np.ones((2, 40), np.float32), 4, 32)


# --- repack ---------------------------------------------------------------------------------------

def gpu_linear(rng: np.random.Generator, n: int, k: int, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Random GPU codes (K, N) and float16 scales (n_groups, N), with the float16 corner cases among the scales."""
    codes = rng.integers(0, 1 << bits, size=(k, n), dtype=np.uint8)
    scales = (rng.standard_normal((1 if group == -1 else k // group, n)) * 0.02).astype(np.float16)
    flat = scales.reshape(-1)
    flat[: 6] = np.array([0.0, -0.0, 6.0e-8, -3.0e-5, 65504.0, 1.0], np.float16)[: flat.size]   # subnormals, max
    return codes, scales


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,n,k", [(32, 72, 96), (64, 104, 192), (128, 40, 384), (-1, 72, 96)])
def test_repack_equals_reference_from_every_container(bits, group, n, k):
    rng = np.random.default_rng(bits + group + n)
    codes, scales = gpu_linear(rng, n, k, bits, group)
    geom, q_ref, s_ref = repack_gpu_codes(codes, scales, bits, group)
    # the reference: codes moved and scales widened exactly, dequantizing as the GPU layout does, and invertible
    assert geom == linear_geometry(n, k, bits, group)
    back_c, back_s = to_gpu_codes(q_ref, s_ref, geom)
    np.testing.assert_array_equal(back_c, codes)
    np.testing.assert_array_equal(back_s.view(np.uint16), scales.view(np.uint16))
    g_idx = np.arange(k) // (k if group == -1 else group)
    np.testing.assert_array_equal(unpack_linear(q_ref, s_ref, geom), dequantize_kn(codes, scales, g_idx, bits))
    gg = GptqGeometry(n, k, bits, group)
    gptq = gptq_pack(codes, scales, gg)
    ct = ct_pack(codes, scales, gg)
    with LinearKernels(n_threads=2) as lin:
        sources = {
            "u8 (K, N)": (codes, scales, False),
            "u8 (N, K).T": (np.ascontiguousarray(codes.T).T, scales, False),
            "gptq qweight": (gptq["qweight"], gptq["scales"], True),
            "compressed-tensors weight_packed.T": (ct["weight_packed"].T, ct["weight_scale"].T, True),
        }
        for name, (c, s, packed) in sources.items():
            q, sc = lin.repack(c, s, bits, group, packed=packed)
            np.testing.assert_array_equal(q, q_ref, err_msg=name)
            np.testing.assert_array_equal(sc.view(np.uint32), s_ref.view(np.uint32), err_msg=name)
        # into preallocated arrays (e.g. a mapped file)
        out = (np.zeros_like(q_ref), np.zeros_like(s_ref))
        assert lin.repack(codes, scales, bits, group, out=out)[0] is out[0]
        np.testing.assert_array_equal(out[0], q_ref)
        # float16 tiles: the GPU scales' bits moved (padding +0), the reference's f16 layout byte for byte
        geom16, q16_ref, s16_ref = repack_gpu_codes(codes, scales, bits, group, "f16")
        assert geom16.scale_dtype == "f16" and s16_ref.dtype == np.float16
        for name, (c, s, packed) in sources.items():
            q16, s16 = lin.repack(c, s, bits, group, packed=packed, scale_dtype="f16")
            np.testing.assert_array_equal(q16, q_ref, err_msg=name)
            np.testing.assert_array_equal(s16.view(np.uint16), s16_ref.view(np.uint16), err_msg=name)
        np.testing.assert_array_equal(unpack_linear(q16_ref, s16_ref, geom16), unpack_linear(q_ref, s_ref, geom))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (4, -1)])
def test_float16_scale_tiles_run_as_their_float32_widening_bitwise(backend, bits, group):
    """kt_add_linear_ex with KT_F16 scales: the same outputs, bit for bit, as the float32 scales they widen to, on
    every backend (decode streams and prefill tiles), plain and grouped submits."""
    n, k = 88, 192
    rng = np.random.default_rng(bits * 5 + group)
    codes, scales = gpu_linear(rng, n, k, bits, group)
    scales[np.abs(scales) > 1] = 0.5                              # no float16 max: outputs stay finite
    with LinearKernels(n_threads=2, backend=backend) as lin:
        q32, s32 = lin.repack(codes, scales, bits, group)
        q16, s16 = lin.repack(codes, scales, bits, group, scale_dtype="f16")
        lin.add(0, q32, s32, n, k, bits, group)
        lin.add(1, q16, s16, n, k, bits, group)
        assert lin.geometry(1).scale_dtype == "f16"
        for T in (1, 5, 19):
            x = rng.standard_normal((T, k)).astype(np.float32)
            np.testing.assert_array_equal(lin.forward(1, x), lin.forward(0, x), err_msg=f"T={T}")
            xg, outs = torch.from_numpy(rng.standard_normal((T, 5, k)).astype(np.float32)), []
            for lid in (0, 1):
                out = torch.empty((T, 5, 16))
                lin.submit_grouped(lid, xg, out, 0, 16)
                lin.sync()
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), f"grouped T={T}"


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors", "marlin"])
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_layers_run_repacked(fmt, bits):
    """A real GPU-format Linear (ktlayouts' packers) repacked at load runs within the activation-quantization bound of
    a matmul on ktlayouts.gpu_formats' dequantization of the stored tensors."""
    rng = np.random.default_rng(zlib.crc32(f"{fmt}/{bits}".encode()))  # str hashes change per process
    n, k, group = 128, 256, 128                                    # Marlin tiling: N % 64, K % 128
    codes, scales = gpu_linear(rng, n, k, bits, group)
    scales = np.abs(scales).clip(1e-3, 0.05).astype(np.float16)
    gg = GptqGeometry(n, k, bits, group)
    x = rng.standard_normal((9, k)).astype(np.float32)
    with LinearKernels(n_threads=2) as lin:
        if fmt == "gptq":
            t = gptq_pack(codes, scales, gg)
            lin.add_gpu(0, t["qweight"], t["scales"], bits, group, packed=True)
        elif fmt == "compressed-tensors":
            t = ct_pack(codes, scales, gg)
            lin.add_gpu(0, t["weight_packed"].T, t["weight_scale"].T, bits, group, packed=True)
        else:
            t = marlin_pack(codes, scales, gg)
            t["weight_shape"] = np.array([n, k], np.int64)
            c, s = marlin_unpack(t, gg)                            # Marlin's permutation undone by ktlayouts
            lin.add_gpu(0, c, s, bits, group)
        w = dequantize_linear(f"gpu-{fmt}-int{bits}", t).astype(np.float64)
        got = lin.forward(0, x)
    geom = linear_geometry(n, k, bits, group)
    _, bound = quantized_reference(x, w, geom)
    excess = np.abs(got - x.astype(np.float64) @ w.T) - bound - 1e-5 * (np.abs(x) @ np.abs(w).T)
    assert excess.max() <= 0, f"{fmt}: beyond the activation-quantization bound by {excess.max():.3g}"


@pytest.mark.parametrize("entry", GOLDEN_LINEARS, ids=lambda e: e["file"])
def test_golden_gpu_tensors_repack_and_run(entry):
    """tests/golden: tensors written by the public packers (vLLM's gptq/Marlin helpers, compressed-tensors). Every
    container, repacked in C++, gives the reference tiles; the op on them is within the activation-quantization
    bound of x @ W^T for W = (code - Z) * scale (the golden README's formula, in float64)."""
    d = np.load(GOLDEN / entry["file"])
    bits, group, n, k = entry["bits"], entry["group_size"], entry["N"], entry["K"]
    _, q_ref, s_ref = repack_gpu_codes(d["codes_kn"], d["scales_fp16"], bits, group)
    codes, scales = marlin_unpack({"qweight": d["marlin_qweight"], "scales": d["marlin_scales"]},
                                  GptqGeometry(n, k, bits, group))
    sources = {
        "codes_kn": (d["codes_kn"], d["scales_fp16"], False),
        "gptq_qweight": (d["gptq_qweight"], d["scales_fp16"], True),
        "ct_weight_packed.T": (d["ct_weight_packed"].T, d["ct_weight_scale"].T, True),
        "marlin (ktlayouts unpack)": (codes, scales, False),
    }
    w = ((d["codes_kn"].astype(np.float64) - (1 << (bits - 1)))
         * np.repeat(d["scales_fp16"].astype(np.float64), k if group == -1 else group, axis=0)).T
    x = np.random.default_rng(entry["K"] + entry["N"]).standard_normal((5, k)).astype(np.float32)
    with LinearKernels(n_threads=2) as lin:
        for name, (c, s, packed) in sources.items():
            q, sc = lin.repack(c, s, bits, group, packed=packed)
            np.testing.assert_array_equal(q, q_ref, err_msg=name)
            np.testing.assert_array_equal(sc, s_ref, err_msg=name)
        lin.add(0, q_ref, s_ref, n, k, bits, group)
        got = lin.forward(0, x)
    _, bound = quantized_reference(x, w, linear_geometry(n, k, bits, group))
    excess = np.abs(got - x.astype(np.float64) @ w.T) - bound - 1e-5 * (np.abs(x) @ np.abs(w).T)
    assert excess.max() <= 0, f"beyond the activation-quantization bound by {excess.max():.3g}"


def test_unpack_codes_round_trip():
    rng = np.random.default_rng(4)
    geom = linear_geometry(50, 70, 4, 32)
    w = rng.standard_normal((50, 70)).astype(np.float32)
    q, s = pack_linear(w, geom)
    codes, sc = unpack_linear_codes(q, s, geom)
    assert codes.shape == (50, 70) and sc.shape == (50, 3)
    np.testing.assert_array_equal(unpack_linear(q, s, geom), (codes.astype(np.float32) - 8) * np.repeat(sc, 32, 1)[:, :70])
