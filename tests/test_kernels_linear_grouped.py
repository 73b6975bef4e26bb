"""The Linear op's grouped submit (kt_linear_submit_grouped: one Linear over row groups, each with its own input) and
MLA's absorbed kv_b on it (ktrun.ops.kernel_linear.AbsorbedKvB).

References are independent of the op: the weights come from ktlayouts' registered unpack (unpack_linear), the
products are numpy / torch float math on them. The grouped op equals, per group, numpy on the int8-quantized
activations (the README's activation quantization, ktlayouts.cpu_expert.quantize_activations) to float rounding,
and is bit-identical to the scalar backend. The absorbed pair equals the float einsums of the absorbed form on the
dequantized kv_b within the int8 activation rounding bound."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from ktlayouts.cpu_linear import linear_geometry, pack_linear, to_gpu_codes, unpack_linear
from ktrun.ops.kernel_linear import AbsorbedKvB, KernelLinear
from ktrun.ops.library import KernelError
from ktrun.ops.linear import LinearKernels
from test_kernels_helpers import assert_close, backend_params
from test_kernels_linear import quantized_reference


def _grouped_reference(x: np.ndarray, w: np.ndarray, geom, row0: int, step: int, rows: int) -> np.ndarray:
    """x (T, J, K), w (N, K) float64 -> (T, J, rows): group j through W's rows row0 + j*step .. + rows."""
    T, J, _ = x.shape
    out = np.empty((T, J, rows))
    for j in range(J):
        wj = w[row0 + j * step: row0 + j * step + rows]
        out[:, j] = quantized_reference(x[:, j], wj, linear_geometry(rows, geom.k, geom.bits, geom.group_size))[0]
    return out


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,k", [(32, 96), (64, 128), (-1, 100)])
@pytest.mark.parametrize("T", [1, 3, 9, 20])
@pytest.mark.parametrize("rows", [32, 160])                  # whole groups per item; groups cut in block chunks
def test_grouped_submit_matches_numpy_and_scalar(backend, bits, group, k, T, rows):
    J, row0, step = 5, 16, rows + 16                          # groups overlap nothing, skip rows, end before N
    n = row0 + (J - 1) * step + rows + 8                      # N not a multiple of 16 past the last group
    rng = np.random.default_rng(bits * 7 + k + T)
    geom = linear_geometry(n, k, bits, group)
    qw, sc = pack_linear((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), geom)
    w = unpack_linear(qw, sc, geom).astype(np.float64)
    # x (T, J, K) as a strided view: groups 2K apart, tokens 2JK apart (only the last dim contiguous)
    base = torch.from_numpy(rng.standard_normal((T, J, 2 * k)).astype(np.float32))
    x = base[:, :, :k]
    ref = _grouped_reference(x.numpy().astype(np.float64), w, geom, row0, step, rows)
    outs = {}
    for b in {backend, "scalar"}:
        with LinearKernels(n_threads=2, backend=b) as lin:
            lin.add(0, qw, sc, n, k, bits, group)
            out = torch.full((T, J, rows + 16), -7.0)[:, :, 8:8 + rows]     # strided output view
            lin.submit_grouped(0, x, out, row0, step)
            lin.sync()
            outs[b] = out.clone().numpy()
    assert_close(outs[backend], ref, 1e-5, f"{backend} grouped vs numpy")
    np.testing.assert_array_equal(outs[backend], outs["scalar"])


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bits,group,k", [(4, -1, 128), (8, 32, 96)])
@pytest.mark.parametrize("T", [1, 3, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_submit_with_shared_scaled_inputs(backend, bits, group, k, T, dtype):
    """x_scale / shared inputs (MLA's W_uk: each head's query read by its ng scale groups, each scaled): equal, bit
    for bit, to the plain grouped submit of the scaled inputs materialized in float32, and to the scalar twin."""
    J, div, rows = 12, 4, 16                                  # 3 input vectors, each read by 4 adjacent groups
    n = J * rows
    rng = np.random.default_rng(bits + k + T)
    geom = linear_geometry(n, k, bits, group)
    qw, sc = pack_linear((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), geom)
    base = torch.from_numpy(rng.standard_normal((T, J // div, k + 64)).astype(np.float32)).to(dtype)
    x = base[:, :, 32:32 + k]                                 # a strided view, as q_nope is of q
    scale = torch.from_numpy(rng.uniform(0.5, 2.0, (J, k)).astype(np.float32))
    materialized = (x.float().repeat_interleave(div, dim=1) * scale[None])    # (T, J, K)
    outs = {}
    for b in {backend, "scalar"}:
        with LinearKernels(n_threads=2, backend=b) as lin:
            lin.add(0, qw, sc, n, k, bits, group)
            for name, xx, xs in (("scaled", x, scale), ("plain", materialized, None)):
                out = torch.empty((T, J, rows))
                lin.submit_grouped(0, xx, out, 0, rows, x_scale=xs)
                lin.sync()
                outs[b, name] = out.numpy()
    np.testing.assert_array_equal(outs[backend, "scaled"], outs[backend, "plain"])
    np.testing.assert_array_equal(outs[backend, "scaled"], outs["scalar", "scaled"])
    w = unpack_linear(qw, sc, geom).astype(np.float64)
    ref = _grouped_reference(materialized.numpy().astype(np.float64), w, geom, 0, rows, rows)
    assert_close(outs[backend, "scaled"], ref, 1e-5, f"{backend} scaled grouped vs numpy")


def test_grouped_submit_bad_input():
    geom = linear_geometry(64, 64, 4, 32)
    qw, sc = pack_linear(np.ones((64, 64), np.float32), geom)
    with LinearKernels(n_threads=1) as lin:
        lin.add(3, qw, sc, 64, 64, 4, 32)
        x, out = torch.zeros(1, 2, 64), torch.zeros(1, 2, 32)
        with pytest.raises(KernelError, match="end past N=64"):
            lin.submit_grouped(3, x, out, 16, 32)             # group 1: rows 48..80 > 64
        with pytest.raises(KernelError, match="multiples of 16"):
            lin.submit_grouped(3, x, torch.zeros(1, 2, 24), 0, 24)
        with pytest.raises(ValueError, match="expected float32/bfloat16"):
            lin.submit_grouped(3, torch.zeros(1, 2, 48), out, 0, 32)
        with pytest.raises(KeyError, match="was not added"):
            lin.submit_grouped(9, x, out, 0, 32)
        with pytest.raises(ValueError, match="multiple of x's 2 groups"):
            lin.submit_grouped(3, x, torch.zeros(1, 3, 32), 0, 32)
        with pytest.raises(ValueError, match="x_scale"):
            lin.submit_grouped(3, x, out, 0, 32, x_scale=torch.ones(2, 32))


def _kv_b(lin: LinearKernels, rng, nh, dn, dv, R, bits, group) -> tuple[KernelLinear, np.ndarray]:
    """A random kv_b_proj as a converted GPU layer would arrive (GPU codes, float16 scales), repacked on the op."""
    n = nh * (dn + dv)
    geom = linear_geometry(n, R, bits, group)
    qw, sc = pack_linear((rng.standard_normal((n, R)) / np.sqrt(R)).astype(np.float32), geom)
    codes_kn, scales_gn = to_gpu_codes(qw, sc.astype(np.float16).astype(np.float32), geom)
    qw, sc = lin.repack(codes_kn, scales_gn, bits, group)
    lin.add(lin.n_linears, qw, sc, n=n, k=R, bits=bits, group_size=group)
    kl = KernelLinear("kv_b_proj.weight", lin, lin.n_linears - 1, n, R, R, geom, qw, sc, torch.float32)
    return kl, unpack_linear(qw, sc, geom).astype(np.float64)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("m", [1, 4, 11])
def test_absorbed_kv_b_matches_float_math_on_the_dequantized_weights(bits, group, m):
    nh, dn, dv, R = 4, 32, 48, 256
    rng = np.random.default_rng(bits + m + group)
    with LinearKernels(n_threads=2) as lin:
        lin.add(0, *pack_linear(np.ones((16, 64), np.float32), linear_geometry(16, 64, 4, 32)), 16, 64, 4, 32)
        kv_b, w = _kv_b(lin, rng, nh, dn, dv, R, bits, group)
        ab = AbsorbedKvB(kv_b, nh, dn, dv, R)
        wk = w.reshape(nh, dn + dv, R)
        w_uk, w_uv = wk[:, :dn], wk[:, dn:]                                      # (nh, dn, R), (nh, dv, R)
        q = rng.standard_normal((m, nh, dn)).astype(np.float32)
        got = ab.q_latent(torch.from_numpy(q)).numpy()
        ref = np.einsum("mhd,hdr->mhr", q.astype(np.float64), w_uk)
        # int8 activations: each input of q * s moves by at most half its row's step; bound it per (m, h, r)
        assert got.shape == (m, nh, R)
        assert_close(got, ref, 2e-2, "q_latent vs float einsum")
        lat = rng.standard_normal((m, nh, R)).astype(np.float32)
        got_v = ab.values(torch.from_numpy(lat)).numpy()
        ref_v = np.einsum("mhr,hvr->mhv", lat.astype(np.float64), w_uv)
        assert got_v.shape == (m, nh, dv)
        assert_close(got_v, ref_v, 2e-2, "values vs float einsum")
        # W_uv runs on kv_b's own tiles: the grouped op on them is the plain op on each head's row slice
        for h in range(nh):
            row = kv_b.lin.forward(kv_b.id, lat[:, h])[:, h * (dn + dv) + dn: (h + 1) * (dn + dv)]
            np.testing.assert_array_equal(got_v[:, h], row)
        # the transposed codes hold exactly W_uk's codes: the unit-scale tiles times the input scales are W_uk^T
        uk_geom = linear_geometry(nh * R, dn, bits, -1)
        w_t = unpack_linear(ab.uk_q, ab.uk_s, uk_geom).reshape(nh, R, dn)
        s = ab.s_uk.numpy().reshape(nh, -1, dn)                                  # (nh, ng, dn)
        w_t = w_t * np.repeat(s, R // s.shape[1], axis=1)
        np.testing.assert_allclose(w_t, w_uk.transpose(0, 2, 1), rtol=0, atol=1e-7)
        assert ab.nbytes < nh * (dn + dv) * R * 4 / 2     # under half the float32 pair it replaces


def test_absorbed_kv_b_refuses_shapes_it_cannot_hold():
    with LinearKernels(n_threads=1) as lin:
        kv_b, _ = _kv_b(lin, np.random.default_rng(0), 2, 24, 32, 128, 4, 32)    # dn = 24: not whole blocks
        assert not AbsorbedKvB.supported(kv_b, 2, 24, 32, 128)
        assert not AbsorbedKvB.supported(torch.zeros(112, 128), 2, 24, 32, 128)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_act_order_gptq_runs_on_the_op_through_an_input_permutation(bits, group):
    """An act-order GPTQ Linear (permuted g_idx, as stored by GPTQ checkpoints) is repacked, not dequantized: y equals
    numpy on ktlayouts' dequantization (dequantize_kn with that g_idx) to float rounding of the int8 activations of
    the permuted input."""
    from ktlayouts.gptq import GptqGeometry, dequantize_kn, gptq_pack
    from ktrun.ops.kernel_linear import act_order_perm, repack_linear

    n, k = 48, 256
    rng = np.random.default_rng(bits * 3 + group)
    gg = GptqGeometry(n, k, bits, group)
    codes = rng.integers(0, 1 << bits, size=(k, n), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, size=gg.scales_shape).astype(np.float16)
    g_idx = (rng.permutation(k) // group).astype(np.int32)                 # every group G channels, scattered
    t = gptq_pack(codes, scales, gg, g_idx=g_idx)
    w = dequantize_kn(codes, scales, g_idx, bits).astype(np.float64)        # (N, K) in the input's channel order
    x = rng.standard_normal((5, k)).astype(np.float32)
    with LinearKernels(n_threads=2) as lin:
        kl = repack_linear(lin, 0, "q_proj.weight", f"gpu-gptq-int{bits}", t, torch.float32)
        assert kl is not None and kl.perm is not None
        got = kl(torch.from_numpy(x)).numpy()
        perm = act_order_perm(g_idx, group)
        ref, _ = quantized_reference(x[:, perm], w[:, perm], linear_geometry(n, k, bits, group))
        assert_close(got, ref, 1e-5, "act-order Linear vs numpy")
        np.testing.assert_allclose(kl.dequantize().numpy(), w, rtol=0, atol=1e-7)
        # a second Linear with another order does not share one submission with it
        t2 = gptq_pack(codes, scales, gg, g_idx=(rng.permutation(k) // group).astype(np.int32))
        kl2 = repack_linear(lin, 1, "k_proj.weight", f"gpu-gptq-int{bits}", t2, torch.float32)
        assert kl.shares_input_with(kl) and not kl.shares_input_with(kl2)
    assert act_order_perm(np.array([0, 0, 0, 1]), 2) is None                 # groups of 3 and 1 channels


def test_decode_rows_past_the_serial_limit_stay_on_kt_mla_attend(monkeypatch):
    """More concurrent decode rows than SERIAL_MAX_ROWS (16 users) stay on kt_mla_attend, all requests in one
    kt_mla_attend_batch call (one pool job per layer, not one per request), and each request's output has the bits it
    has decoded alone: serving many users costs one batched step, not torch's per-request GEMMs (which made a 16-row
    step ~3x slower than the 8-row one), and changes no one's tokens."""
    from types import SimpleNamespace

    from ktrun.models import attention
    from ktrun.ops import glue
    nh, dn, dr, dv, R = 4, 32, 16, 48, 256
    m = 2 * attention.SERIAL_MAX_ROWS
    rng = np.random.default_rng(7)
    calls, batch_calls = [], []
    real, real_batch = glue.mla_attend, glue.mla_attend_batch
    monkeypatch.setattr(glue, "mla_attend", lambda *a: (calls.append(1), real(*a))[1])
    monkeypatch.setattr(glue, "mla_attend_batch", lambda *a: (batch_calls.append(len(a[2])), real_batch(*a))[1])
    with LinearKernels(n_threads=2) as lin:
        kv_b, _ = _kv_b(lin, rng, nh, dn, dv, R, 4, 32)
        w = {"a.kv_b_proj.weight": kv_b}
        g = torch.Generator().manual_seed(7)
        q_nope, q_rot = torch.randn(m, nh, dn, generator=g), torch.randn(m, nh, dr, generator=g)
        lats = [[torch.randn(5 + i, R + dr, generator=g)] for i in range(m)]        # contexts of 5 .. 5 + m - 1

        def attend(rows: list[int]) -> torch.Tensor:
            seqs = [SimpleNamespace(offset=j, n=1, start=lats[i][0].shape[0] - 1) for j, i in enumerate(rows)]
            o = torch.zeros(len(rows), nh, dv)
            attention._absorbed_attention(w, "a.", nh, dn, dr, dv, R, 0.125, torch.zeros(len(rows), 8), len(rows),
                                          q_nope[rows], lambda: q_rot[rows],
                                          [(s, lats[i], None) for s, i in zip(seqs, rows)], SimpleNamespace(seqs=seqs), o)
            return o
        together = attend(list(range(m)))
        assert batch_calls == [m] and not calls
        for i in range(m):
            assert torch.equal(attend([i])[0], together[i]), i


def test_several_new_rows_of_a_request_each_get_the_bits_of_their_token_decoded_alone(monkeypatch):
    """A request's n new rows under the plain causal mask (a speculative verify of 1 + k rows, a short chunk) stay on
    kt_mla_attend_batch, each row over its causal prefix: every row has the bits of its token decoded alone, so a
    verify forward gives exactly the plain decode's numbers. Another mask (an indexer's selection) keeps torch's
    path."""
    from types import SimpleNamespace

    from ktrun.models import attention
    from ktrun.models.kv_cache import causal_scores_mask
    from ktrun.ops import glue
    nh, dn, dr, dv, R = 4, 32, 16, 48, 256
    rng = np.random.default_rng(11)
    batch_rows = []
    real_batch = glue.mla_attend_batch
    monkeypatch.setattr(glue, "mla_attend_batch", lambda *a: (batch_rows.append(len(a[2])), real_batch(*a))[1])
    with LinearKernels(n_threads=2) as lin:
        kv_b, _ = _kv_b(lin, rng, nh, dn, dv, R, 4, 32)
        w = {"a.kv_b_proj.weight": kv_b}
        g = torch.Generator().manual_seed(11)
        start, n = 6, 4                                           # 6 cached positions, then 4 new rows
        lat = torch.randn(start + n, R + dr, generator=g)
        runs = [lat[:5], lat[5:]]                                 # two KV blocks
        q_nope, q_rot = torch.randn(n, nh, dn, generator=g), torch.randn(n, nh, dr, generator=g)

        def attend(rows: range, mask) -> torch.Tensor:
            s = SimpleNamespace(offset=0, n=len(rows), start=start + rows.start)
            o = torch.zeros(len(rows), nh, dv)
            cut = attention._prefix(runs, start + rows.stop)
            attention._absorbed_attention(w, "a.", nh, dn, dr, dv, R, 0.125, torch.zeros(len(rows), 8), len(rows),
                                          q_nope[rows.start:rows.stop], lambda: q_rot[rows.start:rows.stop],
                                          [(s, cut, mask)], SimpleNamespace(seqs=[s]), o)
            return o
        together = attend(range(n), causal_scores_mask(n, start, start + n, "cpu", None))
        assert batch_rows == [n]
        for r in range(n):
            assert torch.equal(attend(range(r, r + 1), None)[0], together[r]), r
        batch_rows.clear()
        other = causal_scores_mask(n, start, start + n, "cpu", None).clone()
        other[-1, 0] = False                                      # not the causal mask: torch's masked path
        masked = attend(range(n), other)
        assert batch_rows == [] and torch.allclose(masked[:-1], together[:-1], rtol=1e-4, atol=1e-5)


def test_absorbed_attention_overlapped_query_is_the_concatenated_one(monkeypatch):
    """MLA's absorbed form on the op, torch's attention: decode-sized rows build the scaled query [q_lat | q_rot] *
    scale in place (the rotary half while W_uk's job runs); larger ones concatenate then scale. Same products: same
    bits. And the decode rows' default, scores / softmax / latent output in kt_mla_attend (its own summation
    order), within float32 rounding of those."""
    from types import SimpleNamespace

    from ktrun.models import attention
    nh, dn, dr, dv, R, S = 4, 32, 16, 48, 256, 7
    rng = np.random.default_rng(5)
    with LinearKernels(n_threads=2) as lin:
        kv_b, _ = _kv_b(lin, rng, nh, dn, dv, R, 4, 32)
        w = {"a.kv_b_proj.weight": kv_b}
        g = torch.Generator().manual_seed(5)
        outs = []
        serial = attention.SERIAL_MAX_ROWS
        for serial_rows, on_kernels in ((serial, False), (0, False), (serial, True)):
            monkeypatch.setattr(attention, "SERIAL_MAX_ROWS", serial_rows)
            with monkeypatch.context() as m:
                if not on_kernels:
                    m.setattr(attention, "_attend_on_kernels", lambda *a: False)
                g.manual_seed(5)
                q_nope, q_rot = torch.randn(2, nh, dn, generator=g), torch.randn(2, nh, dr, generator=g)
                lats = [torch.randn(S, R + dr, generator=g)]
                seqs = [SimpleNamespace(offset=i, n=1, start=S - 1) for i in range(2)]
                o = torch.zeros(2, nh, dv)
                attention._absorbed_attention(w, "a.", nh, dn, dr, dv, R, 0.125, torch.zeros(2, 8), 2, q_nope,
                                              lambda q_rot=q_rot: q_rot, [(s, lats, None) for s in seqs],
                                              SimpleNamespace(seqs=seqs), o)
                outs.append(o)
        assert isinstance(w["a.kv_b_proj.absorbed"], AbsorbedKvB)
        assert outs[0].abs().sum() > 0 and torch.equal(outs[0], outs[1])
        torch.testing.assert_close(outs[2], outs[0], rtol=1e-5, atol=1e-5)
