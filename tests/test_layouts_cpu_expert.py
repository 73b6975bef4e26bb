"""CPU expert layouts: pack/unpack round trips, the AMX-semantics reference against a plain matmul, sharding."""
import numpy as np
import pytest
from ktlayouts.cpu_expert import (
    LayoutError,
    MatrixGeometry,
    amx_reference_matmul,
    pack_codes,
    pack_expert_matrix,
    quantize,
    quantize_activations,
    unpack_codes,
    unpack_expert_matrix,
)
from ktlayouts.expert_shards import ShardPlan, nodes_for_shards

SHAPES = [(48, 96), (64, 256), (100, 130)]      # includes shapes that are not tile multiples


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_unpack_round_trip_and_amx_reference(bits, group, shape):
    rng = np.random.default_rng(hash((bits, group, shape)) % 2**32)
    n, k = shape
    geom = MatrixGeometry(n, k, bits, group)
    w = rng.standard_normal((n, k)).astype(np.float32)
    codes, _ = quantize(w, geom)
    qweight, scales = pack_expert_matrix(w, geom)
    assert qweight.shape == geom.qweight_shape and qweight.nbytes == geom.qweight_nbytes
    assert scales.nbytes == geom.scales_nbytes
    np.testing.assert_array_equal(unpack_codes(qweight, geom), codes)
    np.testing.assert_array_equal(pack_codes(unpack_codes(qweight, geom), geom), qweight)
    wd = unpack_expert_matrix(qweight, scales, geom)
    # quantization error bound: half a step of the group's scale
    step = np.abs(w).max() / (2 ** (bits - 1) - 1)
    assert np.abs(wd - w).max() <= step
    # AMX tile semantics on the packed bytes == plain matmul of dequantized weights and activations
    x = rng.standard_normal((5, k)).astype(np.float32)
    a_q, a_s = quantize_activations(x, geom)
    xd = (a_q.astype(np.float64).reshape(5, geom.n_groups, geom.group) * a_s[..., None]).reshape(5, geom.k_pad)[:, :k]
    expected = xd @ wd.astype(np.float64).T
    got = amx_reference_matmul(x, qweight, scales, geom)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_padding_is_zero_codes():
    geom = MatrixGeometry(20, 70, 4, 32)
    codes, scales = quantize(np.ones((20, 70), np.float32), geom)
    assert (codes[20:] == 8).all() and (codes[:, 70:] == 8).all() and (scales[20:] == 0).all()


def test_bf16_round_trip():
    geom = MatrixGeometry(40, 100, 16, -1)
    w = np.random.default_rng(1).standard_normal((40, 100)).astype(np.float32)
    qweight, scales = pack_expert_matrix(w, geom)
    assert scales is None and qweight.shape == (3, 4, 1024)
    np.testing.assert_allclose(unpack_expert_matrix(qweight, None, geom), w, rtol=2 ** -8)


@pytest.mark.parametrize("group", [48, 0, 96])
def test_untileable_group_sizes_are_rejected(group):
    with pytest.raises(LayoutError, match="group size"):
        MatrixGeometry(16, 128, 4, group)


def test_shard_plan_units_and_errors():
    plan = ShardPlan(intermediate=160, group_size=64, n_shards=2)
    assert plan.intermediate_pad == 192 and plan.shard_ranges() == [(0, 64), (64, 192)]
    assert ShardPlan(160, 128, 2).shard_ranges() == [(0, 128), (128, 256)]
    with pytest.raises(LayoutError, match="numa-nodes"):
        ShardPlan(intermediate=100, group_size=128, n_shards=2)


def test_nodes_for_shards_cover_everything_once():
    for s in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 8):
            pieces = [p for node in nodes_for_shards(s, m) for p in node]
            for shard in range(s):
                spans = sorted((a, b) for (x, a, b) in pieces if x == shard)
                assert spans[0][0] == 0.0 and spans[-1][1] == 1.0
                assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
