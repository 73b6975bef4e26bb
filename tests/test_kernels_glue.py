"""kt_rms_norm and kt_rope (ABI 10; ktrun.ops.glue): float32 RMSNorm rows, optionally after a residual add, in one call on the
calling thread. It replaces torch's CPU F.rms_norm for every T, so it must give torch's bits: checked against the
transformers formula (pow, mean, add, rsqrt, mul, mul as separate torch ops) and F.rms_norm, for row lengths around
torch's vector and cascade boundaries, strided rows, (T, heads, d) inputs and the residual add; plus the numpy
torch float64 formula as an independent bound, and the arguments the C side refuses."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ktrun.models import layers
from ktrun.ops import glue
from ktrun.ops.library import load_library

# row lengths: one vector, a vector + tail, the 4-vector ilp blocks, the cascade's 16-row level steps (16*4*8 =
# 512 floats per level step with 8 lanes), DeepSeek-V3's 512 / 1536 / 7168, a long row just under torch's grain
DIMS = [16, 23, 64, 100, 128, 511, 512, 513, 576, 1536, 4104, 7168, 7171, 32767]


def _formula(s: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return h if w is None else w * h


@pytest.fixture(scope="module")
def lanes() -> int:
    n = glue._lanes()
    assert n in (8, 16), "kt_rms_norm matches neither of torch's vector widths: every norm would fall back to torch"
    return n


@pytest.mark.parametrize("D", DIMS)
def test_rms_norm_is_torchs_bits(lanes, D):
    g = torch.Generator().manual_seed(D)
    for T in (1, 2, 5, 9):
        x = torch.randn(T, D, generator=g) * 4
        w = torch.randn(D, generator=g)
        got = layers.rms_norm(x, w, 1e-6)
        assert torch.equal(got, _formula(x, w, 1e-6)), (T, D)
        assert torch.equal(got, F.rms_norm(x, (D,), w, 1e-6)), (T, D)
        ref = x.double() * torch.rsqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()   # float64
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D", [64, 576, 7168])
def test_residual_add_then_norm_is_torchs_bits(lanes, D):
    g = torch.Generator().manual_seed(D + 1)
    for T in (1, 3, 8):
        x, d, w = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g), torch.randn(D, generator=g)
        s, h = layers.add_rms_norm(x, d, w, 1e-5)
        assert torch.equal(s, x + d) and torch.equal(h, _formula(x + d, w, 1e-5)), (T, D)


def test_strided_rows_heads_and_no_weight(lanes):
    g = torch.Generator().manual_seed(7)
    ckv = torch.randn(3, 576, generator=g)                 # MLA's latent: the first 512 of each 576-float row
    w = torch.randn(512, generator=g)
    assert torch.equal(layers.rms_norm(ckv[:, :512], w, 1e-6), _formula(ckv[:, :512], w, 1e-6))
    q = torch.randn(4, 8, 128, generator=g)                # per-head q/k norm: (T, heads, d)
    wh = torch.randn(128, generator=g)
    got = layers.rms_norm(q, wh, 1e-6)
    assert got.shape == q.shape and torch.equal(got, _formula(q, wh, 1e-6))
    x = torch.randn(2, 100, generator=g)
    assert torch.equal(glue.rms_norm(x, None, 1e-6), _formula(x, None, 1e-6))


def test_unsupported_inputs_stay_on_torch(lanes):
    w = torch.ones(8)
    assert not glue.supported(torch.ones(2, 8), w)                     # shorter than a vector
    assert not glue.supported(torch.ones(1, 40000), torch.ones(40000))  # torch sums it over its threads
    assert not glue.supported(torch.ones(2, 64, dtype=torch.bfloat16), torch.ones(64))
    assert not glue.supported(torch.ones(64, 2).t(), torch.ones(64))    # columns not contiguous
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    wb = torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(layers.rms_norm(x, wb, 1e-6), wb * _formula(x.float(), None, 1e-6).to(torch.bfloat16))


def test_c_side_refuses_bad_arguments(lanes):
    lib = load_library()
    x, out = torch.zeros(1, 64), torch.zeros(1, 64)
    for T, D, ln in [(1, 64, 4), (1, 8, 16), (1, 7, 8), (-1, 64, 8)]:
        assert lib.kt_rms_norm(T, D, x.data_ptr(), D, None, 0, None, 0, None, 1e-6, ln, out.data_ptr(), D) == -1
    # a residual without somewhere to write x + delta
    assert lib.kt_rms_norm(1, 64, x.data_ptr(), 64, x.data_ptr(), 64, None, 0, None, 1e-6, lanes, out.data_ptr(),
                           64) == -1


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_is_the_torch_formula_bits(interleaved):
    """kt_rope through Rope.apply vs the formula in torch ops: MLA's (T, 128, 64) query slice of a wider row, its
    (T, 1, 64) key, and a partial rotary head (the pass-through dims stay torch's cat)."""
    from ktlayouts.families import RopeConfig
    rope = layers.Rope(RopeConfig(kind="default", theta=10000.0, dim=64, interleaved=interleaved))
    g = torch.Generator().manual_seed(11)
    for T in (1, 3):
        cos, sin = rope.cos_sin(torch.arange(5, 5 + T), torch.float32)
        q = torch.randn(T, 128, 192, generator=g)
        for x in (q[..., 128:], q[:, :1, 128:], torch.randn(T, 4, 96, generator=g)):
            assert glue.rope_supported(x[..., :64], cos, sin)
            c, s = cos[:, None, :], sin[:, None, :]
            xr = x[..., :64]
            x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :32], xr[..., 32:])
            want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 64:]], dim=-1)
            got = rope.apply(x, cos, sin)
            assert torch.equal(got, want), (T, tuple(x.shape))
    assert not glue.rope_supported(torch.randn(1, 2, 64, dtype=torch.bfloat16), cos[:1], sin[:1])
