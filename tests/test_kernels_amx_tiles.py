"""The AMX tile kernel (kernels/src/isa_amx.cpp) on many rows per expert, bit for bit the scalar reference: rows in
more than one chunk (over 128 per expert), an odd number of column blocks, groups of one, half and two tile steps
and per-row scales, every scale dtype, and consecutive jobs whose rows sit at the same addresses with new values (a
worker keeps its packed copy of an expert's rows between the calls of one job, named by ActRows::tag). The tile
unit's peak probe answers on AMX and is 0 elsewhere."""
from __future__ import annotations

import numpy as np
import pytest
from ktrun.ops.library import backend_supported
from ktrun.ops.moe import MoEKernels
from test_kernels_helpers import PackedLayer, routing

pytestmark = pytest.mark.skipif(not backend_supported("amx"), reason="CPU lacks the amx backend")

# (bits, group, hidden, intermediate, scale dtype): hidden 96 = 6 column blocks of down (even), 112 = 7 (odd)
CASES = [(4, 64, 112, 128, "f16"), (4, 32, 96, 128, "sub6"), (8, 128, 128, 80, "bf16"), (4, -1, 96, 80, "f32"),
         (8, 32, 112, 64, "f32"), (4, 128, 128, 256, "bf16")]


@pytest.mark.parametrize("bits,group,hidden,inter,scale_dtype", CASES)
def test_tiles_equal_scalar_over_chunks_and_consecutive_jobs(bits, group, hidden, inter, scale_dtype):
    rng = np.random.default_rng(bits * 1000 + hidden + inter)
    layer = PackedLayer(rng, n_experts=3, hidden=hidden, inter=inter, bits=bits, group_size=group,
                        scale_dtype=scale_dtype)
    with MoEKernels(n_threads=2, backend="amx") as moe, MoEKernels(n_threads=2, backend="scalar") as ref:
        layer.add_to(moe)
        layer.add_to(ref)
        T, k = 200, 3   # ~200 rows per expert: two chunks, the second partial
        ids, w = routing(rng, T, k, layer.E)
        for job in range(3):   # same routing, so the same row addresses, new values each job
            x = rng.standard_normal((T, hidden)).astype(np.float32) * (1 + job)
            got = moe.forward(0, x, ids, w)
            assert np.array_equal(got, ref.forward(0, x, ids, w)), f"amx != scalar, job {job}"
        for T in (9, 17, 40):   # a row tile pair's second tile partial or absent
            x = rng.standard_normal((T, hidden)).astype(np.float32)
            ids, w = routing(rng, T, 1, 1)
            assert np.array_equal(moe.forward(0, x, ids, w), ref.forward(0, x, ids, w)), f"amx != scalar, T={T}"


def test_tile_peak_is_measured_on_amx_and_zero_elsewhere():
    with MoEKernels(n_threads=1, backend="amx") as moe:
        tile, vnni = moe.measure_tile_int8_peak(0.05), moe.measure_int8_peak(0.05)
        assert tile > 2 * vnni > 0, (tile, vnni)
    with MoEKernels(n_threads=1, backend="avx512") as moe:
        assert moe.measure_tile_int8_peak(0.05) == 0.0
