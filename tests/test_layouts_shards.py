"""ktlayouts.expert_shards: the one place a NUMA shard (or units of one) is cut out of an expert and put back."""
import numpy as np
import pytest
from ktlayouts.constants import ZERO_POINT
from ktlayouts.cpu_expert import LayoutError, pack_expert_matrix, unpack_expert_matrix
from ktlayouts.expert_shards import (
    ShardPlan,
    join_shards,
    paste_shard,
    shard_codes,
    shard_matrices,
    unit_piece,
)

H = 48


def _expert(i: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"gate": rng.standard_normal((i, H)).astype(np.float32), "up": rng.standard_normal((i, H)).astype(np.float32),
            "down": rng.standard_normal((H, i)).astype(np.float32)}


@pytest.mark.parametrize("i,group,shards,bits", [(200, 32, 3, 8), (256, 128, 2, 4), (100, -1, 1, 4), (130, 64, 2, 16)])
def test_cut_pads_to_the_unit_boundary_and_join_and_paste_undo_it(i, group, shards, bits):
    plan = ShardPlan(i, group, shards, bits=bits)
    w = _expert(i)
    cuts = [shard_matrices(w, plan, s) for s in range(shards)]
    for s, m in enumerate(cuts):
        i0, i1 = plan.shard_range(s)
        assert m["gate"].shape == m["up"].shape == (i1 - i0, H) and m["down"].shape == (H, i1 - i0)
        take = max(0, min(i1, i) - i0)
        assert np.array_equal(m["gate"][:take], w["gate"][i0:i0 + take]) and not m["gate"][take:].any()
        assert np.array_equal(m["down"][:, :take], w["down"][:, i0:i0 + take]) and not m["down"][:, take:].any()
    joined = join_shards(cuts, i)
    pasted = {p: np.full_like(a, np.nan) for p, a in w.items()}
    for s, m in enumerate(cuts):
        for p in w:
            paste_shard(m[p], p, plan, s, pasted[p])
    for p in w:
        assert np.array_equal(joined[p], w[p]) and np.array_equal(pasted[p], w[p])


def test_already_quantized_codes_are_cut_with_zero_point_and_per_group_scales():
    i, g = 192, 32
    plan = ShardPlan(i, g, 2, bits=8)
    rng = np.random.default_rng(1)
    exact = {"gate": (rng.integers(0, 256, (i, H), dtype=np.uint8), rng.random((i, H // g)).astype(np.float32)),
             "down": (rng.integers(0, 256, (H, i), dtype=np.uint8), rng.random((H, i // g)).astype(np.float32))}
    for s in range(2):
        i0, i1 = plan.shard_range(s)
        cut = shard_codes(exact, plan, s)
        take = min(i1, i) - i0
        c, sc = cut["down"]
        assert c.shape == (H, i1 - i0) and sc.shape == (H, (i1 - i0) // g)
        assert np.array_equal(c[:, :take], exact["down"][0][:, i0:i0 + take]) and np.all(c[:, take:] == ZERO_POINT[8])
        assert np.array_equal(sc[:, :take // g], exact["down"][1][:, i0 // g:(i0 + take) // g])
        assert not sc[:, take // g:].any()
        c, sc = cut["gate"]
        assert np.all(c[take:] == ZERO_POINT[8]) and not sc[take:].any()
    with pytest.raises(LayoutError, match="int groups"):
        shard_codes(exact, ShardPlan(i, -1, 2, bits=8), 0)


@pytest.mark.parametrize("group,bits", [(32, 8), (128, 4), (-1, 4), (64, 16)])
def test_unit_pieces_are_views_of_the_packed_shard(group, bits):
    plan = ShardPlan(384, group, 1, bits=bits)
    w = shard_matrices(_expert(384, 2), plan, 0)
    for p in ("gate", "down"):
        geom = plan.down_geometry(0, H) if p == "down" else plan.gate_up_geometry(0, H)
        q, sc = pack_expert_matrix(w[p], geom)
        whole = unpack_expert_matrix(q, sc, geom)
        for u0, u1 in [(0, 1), (1, plan.n_units), (0, plan.n_units)]:
            pq, ps, pg = unit_piece(q, sc, p, geom, plan.unit, u0, u1)
            assert np.shares_memory(pq, q)
            rows = slice(u0 * plan.unit, u1 * plan.unit)
            want = whole[:, rows] if p == "down" else whole[rows]
            assert np.array_equal(unpack_expert_matrix(pq, ps, pg), want)
            sq, ss, _ = unit_piece(q[None], None if sc is None else sc[None], p, geom, plan.unit, u0, u1, stacked=True)
            assert np.array_equal(sq[0], pq) and (ss is None or np.array_equal(ss[0], ps))
