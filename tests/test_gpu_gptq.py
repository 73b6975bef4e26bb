"""RTN and GPTQ for GPU layers: reference rounding, error compensation, damping and its failure modes."""
import logging

import numpy as np
import pytest
import torch
from golden_data import GOLDEN, linear_entries

from ktconvert.gpu.gptq import GptqConfig, GptqError, HessianAccumulator, gptq_quantize
from ktconvert.gpu.rtn import quantize_rtn

ENTRIES = linear_entries()


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_rtn_reproduces_reference_codes_and_scales(entry):
    d = np.load(GOLDEN / entry["file"])
    q = quantize_rtn(torch.from_numpy(d["weight_fp16"].astype(np.float32)), entry["bits"], entry["group_size"])
    assert np.array_equal(q.codes_kn, d["codes_kn"])
    assert q.scales_gn.tobytes() == d["scales_fp16"].tobytes()


def _correlated_inputs(k: int, t: int, seed: int) -> torch.Tensor:
    """Tokens with strongly correlated channels and a few outlier channels, like real LLM activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 * 2 + torch.eye(k)
    scale = torch.ones(k)
    scale[:: k // 8] = 8.0
    return (torch.randn(t, k, generator=torch.Generator().manual_seed(seed + 1)) @ mix) * scale


@pytest.mark.parametrize("bits,group_size,act_order", [(4, 128, False), (4, 32, False), (4, -1, True),
                                                       (8, 64, False), (4, 64, True)])
def test_gptq_beats_rtn_on_layer_output(bits, group_size, act_order):
    k, n = 256, 128
    x = _correlated_inputs(k, 2048, seed=1)
    calib, held_out = x[:1536], x[1536:]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7)) * 0.05
    acc = HessianAccumulator(k)
    for chunk in calib.split(500):
        acc.add(chunk)
    assert acc.tokens == 1536
    assert torch.allclose(acc.h, 2 * calib.T @ calib / 1536, rtol=1e-3, atol=1e-3)
    q, loss = gptq_quantize(w, acc.h, GptqConfig(bits=bits, group_size=group_size, act_order=act_order))
    r = quantize_rtn(w, bits, group_size)
    for xs in (calib, held_out):
        y = xs @ w.T
        e_gptq = float(((xs @ q.dequantize().T - y) ** 2).mean())
        e_rtn = float(((xs @ r.dequantize().T - y) ** 2).mean())
        assert e_gptq < 0.6 * e_rtn, (e_gptq, e_rtn)
    assert loss > 0
    # codes are valid and scales are per group of the input channels the g_idx names
    assert q.codes_kn.shape == (k, n) and q.codes_kn.max() < 2 ** bits
    counts = np.bincount(q.g_idx, minlength=q.geom.n_groups)
    assert np.all(counts == q.geom.group)
    if not act_order:
        assert np.array_equal(q.g_idx, np.arange(k) // q.geom.group)


def test_gptq_is_deterministic():
    x = _correlated_inputs(128, 512, seed=3)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    h = 2 * x.T @ x / 512
    a, _ = gptq_quantize(w, h, GptqConfig(group_size=32))
    b, _ = gptq_quantize(w, h.clone(), GptqConfig(group_size=32))
    assert a.codes_kn.tobytes() == b.codes_kn.tobytes() and a.scales_gn.tobytes() == b.scales_gn.tobytes()


def test_dead_input_channels_are_zeroed():
    x = _correlated_inputs(128, 512, seed=5)
    x[:, 10] = 0
    w = torch.randn(64, 128)
    q, _ = gptq_quantize(w, 2 * x.T @ x / 512, GptqConfig(group_size=-1))
    assert torch.all(q.dequantize()[:, 10] == 0)


def test_indefinite_hessian_is_retried_with_more_damping(caplog):
    x = _correlated_inputs(128, 512, seed=6)
    h = 2 * x.T @ x / 512
    h -= 0.05 * float(torch.diag(h).mean()) * torch.eye(128)    # slightly indefinite: needs damping > 0.05
    ev = torch.linalg.eigvalsh(h)
    assert ev.min() < 0
    with caplog.at_level(logging.WARNING, logger="ktconvert.gpu.gptq"):
        q, _ = gptq_quantize(torch.randn(64, 128), h, GptqConfig(group_size=128), name="layers.0.mlp.down_proj")
    assert "layers.0.mlp.down_proj" in caplog.text and "used 0.1" in caplog.text
    assert q.codes_kn.shape == (128, 64)


@pytest.mark.parametrize("h,msg", [
    (-torch.eye(64), "non-positive mean diagonal"),
    # mean diagonal 31.25 > 0, but eigenvalues of -1000 that no damping up to 1 x mean(diag) can lift
    (torch.diag(torch.cat([torch.full((60,), 100.0), torch.full((4,), -1000.0)])), "even with damping 1"),
    (torch.full((64, 64), float("nan")), "NaN"),
])
def test_non_pd_hessian_raises_naming_the_layer(h, msg):
    with pytest.raises(GptqError, match=rf"model\.layers\.2\.self_attn\.kv_b_proj.*{msg}"):
        gptq_quantize(torch.randn(32, 64), h, GptqConfig(group_size=64), name="model.layers.2.self_attn.kv_b_proj")


def test_column_loop_rounding_is_torch_round_after_the_clamp():
    """The column loop rounds with two additions instead of torch.round (a parallel region per column): the same
    codes once clamped to the code range, ties to even, huge values, infinities and NaN included."""
    from ktconvert.gpu.gptq import _round_half_even_

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(100_000, generator=g) * 10, torch.arange(-40, 40) / 2.0,      # every .5 tie
                   torch.tensor([2.0 ** 22 - 0.5, 2.0 ** 22 + 1, -3e9, 7e30, float("inf"), float("-inf")])])
    for zero, maxq in ((8.0, 15.0), (128.0, 255.0)):
        want = torch.clamp(torch.round(x) + zero, 0.0, maxq)
        got = torch.clamp_(_round_half_even_(x.clone()).add_(zero), 0.0, maxq)
        assert torch.equal(got, want)
        assert torch.equal(_round_half_even_(x[:100_080].clone()), torch.round(x[:100_080]))   # below 2^22: exact
    nan = _round_half_even_(torch.tensor([float("nan")]))
    assert torch.isnan(nan).all()


@pytest.mark.parametrize("k", [64, 300, 1031])
def test_the_inverse_cholesky_factor_by_halves(k):
    """_upper_factor_of_inverse (one Cholesky, then the triangular inverse by halves, _lower_inverse) gives the upper
    U with U^T U = H^-1, the same factor as torch's triangular solve against the identity (sizes below, across and
    well above INVERSE_BLOCK, odd halves included)."""
    from ktconvert.gpu.gptq import _upper_factor_of_inverse

    g = torch.Generator().manual_seed(k)
    x = torch.randn(2 * k, k, generator=g, dtype=torch.float64)
    h = x.T @ x / (2 * k) + 0.01 * torch.eye(k, dtype=torch.float64)
    u = _upper_factor_of_inverse(h)
    assert torch.equal(u, u.triu())
    assert torch.allclose(u.T @ u, torch.linalg.inv(h), rtol=1e-8, atol=1e-10)
    c = torch.linalg.cholesky(torch.flip(h, (0, 1)))
    ref = torch.flip(torch.linalg.solve_triangular(c, torch.eye(k, dtype=h.dtype), upper=False), (0, 1))
    assert torch.allclose(u, ref, rtol=1e-9, atol=1e-11)
    assert _upper_factor_of_inverse(-h) is None                         # not positive definite
