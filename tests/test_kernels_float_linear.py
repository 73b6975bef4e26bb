"""kt_float_linear (ABI 17; ktrun.ops.float_linear): y = x W^T for float32 rows and float32 or bfloat16 weights, the
output head of a CPU forward. Held to float64 numpy products within float32's rounding bound; bf16 weights give the
bits of their float32 widening (the widening is exact); a row's outputs do not depend on the rows beside it, the
thread count or the ISA copy (every output sums in one fixed order); bad arguments are refused. On a loaded model the
head stays bf16 as stored and the forward's logits are its product."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from isa_copies import outputs_per_isa
from ktrun.loaded_model import load_model
from ktrun.models.kv_cache import Batch
from ktrun.ops import float_linear
from ktrun.ops.library import load_library

# (N, K): the default model's head, a V3-wide row, odd row counts (not whole tiles or worker blocks), one tile of K
SHAPES = [(4096, 256), (37, 7168), (1001, 48), (130, 16)]
ROWS = [1, 2, 3, 4, 5, 9, 16, 70]


@pytest.mark.parametrize("N,K", SHAPES)
def test_against_float64_products(N, K, kernel_pool):
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    for T in ROWS:
        x = torch.randn(T, K, generator=g)
        y = float_linear.float_linear(x, w, kernel_pool)
        xd, wd = x.double().numpy(), w.double().numpy()
        want = xd @ wd.T
        bound = K * np.finfo(np.float32).eps * (np.abs(xd) @ np.abs(wd).T) + 1e-30   # K roundings of the sums
        assert y.shape == (T, N) and y.dtype == torch.float32
        assert (np.abs(y.double().numpy() - want) <= bound).all(), (N, K, T)


@pytest.mark.parametrize("N,K", SHAPES)
def test_bf16_weights_give_their_float32_widening_and_rows_their_own_bits(N, K, kernel_pool):
    g = torch.Generator().manual_seed(7 * N + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(max(ROWS), K, generator=g)
    full = float_linear.float_linear(x, w, kernel_pool)
    assert torch.equal(full, float_linear.float_linear(x, w.float(), kernel_pool))     # exact widening
    assert torch.equal(full, float_linear.float_linear(x, w, None))             # calling thread = pool
    for T in ROWS:                                                              # a row's bits whatever the batch
        assert torch.equal(float_linear.float_linear(x[:T], w, kernel_pool), full[:T])
    for t in (0, 5, 69):
        assert torch.equal(float_linear.float_linear(x[t:t + 1], w, kernel_pool), full[t:t + 1])


_DIGEST = """
import hashlib, torch
from ktrun.ops import float_linear
from ktrun.ops.moe import MoEKernels
k = MoEKernels(n_threads=2)
h = hashlib.sha256()
for N, K in ((4096, 256), (37, 7168), (1001, 48)):
    g = torch.Generator().manual_seed(N)
    w = torch.randn(N, K, generator=g).bfloat16()
    for T in (1, 3, 4, 16, 21):
        x = torch.randn(T, K, generator=g)
        h.update(float_linear.float_linear(x, w, k).numpy().tobytes())
        h.update(float_linear.float_linear(x, w.float(), None).numpy().tobytes())
print(h.hexdigest())
"""


def test_every_isa_copy_gives_the_same_bits():
    digests = outputs_per_isa(_DIGEST)
    assert len(digests) >= 2 and len(set(digests.values())) == 1, digests


def test_bad_arguments_are_refused():
    lib = load_library()
    x, y = torch.zeros(2, 64), torch.zeros(2, 8)
    w = torch.zeros(8, 64)

    def call(T=2, N=8, K=64, xs=64, wp=-1, dtype=0, ws=64, ys=8):
        return lib.kt_float_linear(None, T, N, K, x.data_ptr(), xs, w.data_ptr() if wp == -1 else wp, dtype, ws,
                                   y.data_ptr(), ys)
    assert call() == 0
    assert call(K=40) == -1                   # K not a multiple of 16
    assert call(ws=32) == -1                  # rows overlap
    assert call(xs=16) == -1
    assert call(ys=4) == -1
    assert call(dtype=2) == -1                # float16 weights: not a head's dtype
    assert call(wp=None) == -1
    assert call(N=0) == -1
    assert lib.kt_float_linear(None, 0, 8, 64, None, 0, w.data_ptr(), 0, 64, None, 0) == 0    # no rows: nothing
    assert float_linear.takes(w) and not float_linear.takes(w.half()) and not float_linear.takes(torch.zeros(8, 40))
    assert not float_linear.takes(w.t())      # rows not contiguous
    assert call(T=-1) == -1


def test_a_loaded_models_head_is_kept_as_stored_and_gives_the_logits(default_converted):
    loaded = load_model(str(default_converted))
    model = loaded.model
    assert model.lm_head.dtype == torch.bfloat16 and model.lm_head.is_contiguous()
    cache = model.new_cache(64)
    captured = {}
    decoder = model.decoder

    def keep(batch, x):
        s, h = decoder(batch, x)
        captured["h"] = h
        return s, h
    model.decoder = keep
    logits = model.forward(Batch.build([(cache, [5, 17, 42, 9])], "cpu"), all_logits=True)
    want = F.linear(captured["h"].double(), model.lm_head.double())
    assert logits.dtype == torch.float32 and logits.shape == want.shape
    assert torch.allclose(logits.double(), want, rtol=1e-5, atol=1e-5)
