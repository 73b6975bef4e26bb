"""Hot-expert placement arithmetic: the profile and placement file formats, the summary numbers, the strategies and
budgets (ktrun.experts.placement), the memory plan, and the CPU tiles -> GPU format conversion (ktlayouts.expert_gpu)
against the tiles' own dequantization."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from ktlayouts.converted_dir import PROJECTIONS, ExpertGeometry
from ktlayouts.cpu_expert import pack_expert_matrix, unpack_expert_matrix
from ktlayouts.expert_gpu import CHANNEL, expert_codes, gpu_group_step, hot_expert_nbytes, hot_format_ok
from ktlayouts.expert_placement import ExpertPlacement, PlacementFileError, fit_hot_experts
from ktlayouts.expert_profile import (
    ExpertProfile,
    ProfileError,
    coverage,
    normalized_entropy,
    summary_lines,
)
from ktlayouts.expert_shards import join_shards, shard_matrices
from ktlayouts.gpu_formats import gpu_format_for
from ktrun.experts.placement import Budget, PlacementError, allocate, hit_ratio, plan_placement, validated_curve


def make_profile(fit: dict[int, list[int]], held: dict[int, list[int]] | None = None, top_k: int = 2) -> ExpertProfile:
    layers = tuple(fit)
    E = len(next(iter(fit.values())))
    p = ExpertProfile.empty("deepseek_v3", E, top_k, layers, text={"source": "test"})
    for split, counts in (("fit", fit), ("heldout", held or {L: [0] * E for L in layers})):
        for L, c in counts.items():
            p.splits[split].counts[L] = np.array(c, dtype=np.int64)
            p.splits[split].mass[L] = np.array(c, dtype=np.float64) * 0.5
        p.splits[split].tokens = sum(counts[layers[0]]) // top_k
    return p


def test_profile_round_trip_and_errors_name_the_field(tmp_path):
    p = make_profile({1: [6, 2, 0, 4], 2: [3, 3, 3, 3]}, {1: [2, 0, 0, 2], 2: [1, 1, 1, 1]})
    path = tmp_path / "profile.json"
    p.save(path)
    q = ExpertProfile.load(path)
    assert q.moe_layers == (1, 2) and q.tokens("fit") == 6 and q.tokens("heldout") == 2
    assert q.counts("all")[1].tolist() == [8, 2, 0, 6] and q.splits["fit"].mass[1].tolist() == [3.0, 1.0, 0.0, 2.0]
    assert not list(tmp_path.glob("*.partial"))
    d = json.loads(path.read_text())
    for mutate, match in [(lambda d: d.update(format="x"), "not an expert profile"),
                          (lambda d: d.update(version=99), "newer than this reader"),
                          (lambda d: d["splits"]["fit"]["counts"].update({"1": [1, 2]}), "layer 1: 2 counts"),
                          (lambda d: d["splits"]["heldout"]["counts"].update({"2": [1, -1, 0, 0]}), ">= 0"),
                          (lambda d: d["splits"].pop("heldout"), "malformed")]:
        bad = json.loads(json.dumps(d))
        mutate(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ProfileError, match=match):
            ExpertProfile.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="bad.json: not valid JSON"):
        ExpertProfile.load(tmp_path / "bad.json")
    with pytest.raises(ProfileError, match="4 routed experts per layer, the model has 16"):
        q.check_model("deepseek_v3", 16, (1, 2))
    with pytest.raises(ProfileError, match="MoE layers"):
        q.check_model("deepseek_v3", 4, (1, 2, 3))


def test_summary_numbers():
    c = np.array([50, 30, 15, 5, 0, 0, 0, 0])
    assert coverage(c, 1) == 0.5 and coverage(c, 2) == 0.8
    assert coverage(np.array([1, 9, 0, 0]), 1, rank_by=np.array([5, 1, 0, 0])) == 0.1    # ranked by the other split
    p = c[c > 0] / 100
    assert math.isclose(normalized_entropy(c), float(-(p * np.log2(p)).sum() / 3))
    assert math.isclose(normalized_entropy(np.ones(16)), 1.0) and normalized_entropy(np.array([4, 0, 0])) == 0.0
    prof = make_profile({3: [8, 4, 2, 2, 1, 1, 1, 1] * 2}, {3: [1] * 16})
    text = "\n".join(summary_lines(prof))
    assert "top 1 (6%)" in text and "top 8 (50%)" in text and "uniform routing would give" in text
    # layer 3, top 8: fit covers (8+4)*2 + ... = 24 + 8 ... computed independently here
    fit = np.array([8, 4, 2, 2, 1, 1, 1, 1] * 2, dtype=float)
    want = np.sort(fit)[::-1][:8].sum() / fit.sum()
    assert f"{want:.3f} / 0.500" in text


def test_strategies_and_budgets():
    # layer 1: real skew (fit and held-out agree); layer 2: skew in the fit split that the held-out split reverses
    fit = {1: [40, 30, 5, 5, 5, 5, 5, 5], 2: [45, 35, 3, 3, 3, 3, 4, 4]}
    held = {1: [20, 15, 2, 3, 2, 3, 2, 3], 2: [2, 2, 7, 7, 7, 7, 9, 9]}
    prof = make_profile(fit, held)
    layers, E = (1, 2), 8
    assert allocate(prof, E, layers, 4, "uniform") == {1: 2, 2: 2}
    assert sum(allocate(prof, E, layers, 5, "uniform").values()) == 5
    allc = prof.counts("all")
    for cells in (1, 2, 3, 6):
        top = sorted((-int(allc[L][e]), L, e) for L in layers for e in range(E))[:cells]
        assert allocate(prof, E, layers, cells, "frequency") == {L: sum(1 for t in top if t[1] == L) for L in layers}
    # per-layer: the gain is measured where the ranking was not made, so layer 2's fit skew buys nothing
    assert validated_curve(prof, 2)[1] == 2 / 50 and validated_curve(prof, 1)[2] == 35 / 50
    freq = plan_placement(prof, E, layers, Budget(ratio=2 / 16), "frequency")
    per = plan_placement(prof, E, layers, Budget(ratio=2 / 16), "per-layer")
    assert freq.experts == {1: (0,), 2: (0,)} and per.experts == {1: (0, 1), 2: ()}
    assert hit_ratio(prof.counts("heldout"), per.experts) > hit_ratio(prof.counts("heldout"), freq.experts)
    # budgets
    assert Budget(per_layer=3).cells(E, 3) == 9 and Budget(ratio=0.25).cells(E, 3) == 6
    assert Budget(gpu_mem=10**9).cells(E, 3, fit_cells=100) == 24
    with pytest.raises(PlacementError, match="one of"):
        Budget(per_layer=1, ratio=0.5)
    with pytest.raises(PlacementError, match="needs an activation profile"):
        allocate(None, E, layers, 3, "frequency")
    pl = plan_placement(prof, E, layers, Budget(per_layer=2), "uniform", "bf16")
    assert pl.experts == {1: (0, 1), 2: (0, 1)} and pl.cells == 4 and pl.gpu_format == "bf16"
    assert math.isclose(hit_ratio(prof.counts("fit"), pl.experts), (70 + 80) / 200)


def test_placement_file_and_memory_plan(tmp_path):
    pl = ExpertPlacement({3: (5, 1), 4: ()}, "per-layer", "marlin", {"gpu_experts": 2}, {"sha256": "ab"})
    (tmp_path / "p.json").write_bytes(pl.dumps())
    back = ExpertPlacement.load(tmp_path / "p.json")
    assert back.experts == {3: (1, 5), 4: ()} and back.gpu_format == "marlin" and back.cells == 2
    back.check(8, (3, 4))
    with pytest.raises(PlacementFileError, match="layer 3 lists experts"):
        ExpertPlacement({3: (9,)}).check(8, (3, 4))
    with pytest.raises(PlacementFileError, match="layer 7 is not a MoE layer"):
        ExpertPlacement({7: (1,)}).check(8, (3, 4))
    n, plan = fit_hot_experts(gpu_mem=1000, dense_bytes=300, kv_bytes=100, per_expert_bytes=70)
    assert plan["reserve"] == 50 and n == (1000 - 300 - 100 - 50) // 70
    assert fit_hot_experts(100, 300, 0, 10)[0] == 0


@pytest.mark.parametrize("bits,group,hidden,inter,shards", [(4, 128, 256, 160, 1), (4, 32, 96, 64, 1),
                                                           (8, -1, 96, 128, 2), (4, 64, 128, 256, 2)])
def test_gpu_codes_are_the_tiles_exactly(bits, group, hidden, inter, shards):
    """Marlin hot experts dequantize to exactly the CPU tiles' values (scales rounded to float16 only), and the
    byte count the memory plan uses is the size of what the format stores."""
    geo = ExpertGeometry(f"int{bits}-amx", group, 4, hidden, inter, shards, (0,))
    rng = np.random.default_rng(bits + group)
    w = {"gate": rng.standard_normal((inter, hidden)), "up": rng.standard_normal((inter, hidden)),
         "down": rng.standard_normal((hidden, inter))}
    packed = [{p: pack_expert_matrix(m.astype(np.float32), geo.matrix_geometry(p, s))
               for p, m in shard_matrices(w, geo.shard_plan, s).items()} for s in range(shards)]
    deq = join_shards([{p: unpack_expert_matrix(*packed[s][p], geo.matrix_geometry(p, s)) for p in PROJECTIONS}
                       for s in range(shards)], inter)
    step = gpu_group_step(geo)
    assert step is not None and hot_format_ok(geo, "marlin") is None
    fmt, total = gpu_format_for("marlin", bits), 0
    for p in PROJECTIONS:
        codes, scales = expert_codes(geo, p, step, [packed[s][p] for s in range(shards)])
        n, k = codes.shape
        per = k if step == CHANNEL else step
        w32 = (codes.astype(np.float64) - (1 << (bits - 1))) * np.repeat(scales, per, axis=1)
        assert np.array_equal(w32.astype(np.float32), deq[p])                    # f32 scales: exact
        g = fmt.storage_geometry(n, k, step)
        ckn = np.full((g.k, g.n), 1 << (bits - 1), np.uint8)
        ckn[:k, :n] = codes.T
        sgn = np.zeros(g.scales_shape, np.float32)
        sgn[: scales.shape[1], :n] = scales.T
        parts = fmt.pack(ckn, sgn, g, shape=(n, k))
        want = (codes.astype(np.float64) - (1 << (bits - 1))) * np.repeat(scales.astype(np.float16), per, axis=1)
        assert np.allclose(fmt.dequantize(parts), want, rtol=0, atol=1e-6)
        total += sum(a.nbytes for a in parts.values())
    assert hot_expert_nbytes(geo, "marlin") == total
    assert hot_expert_nbytes(geo, "bf16") == 2 * 3 * hidden * inter


def test_formats_that_cannot_hold_the_codes_say_why():
    assert "bf16" in hot_format_ok(ExpertGeometry("bf16", -1, 4, 64, 64, 1, (0,)), "marlin")
    assert "no GPU group length" in hot_format_ok(ExpertGeometry("int4-amx", 64, 4, 64, 80, 1, (0,)), "marlin")
    assert hot_format_ok(ExpertGeometry("int4-amx", 64, 4, 64, 80, 1, (0,)), "bf16") is None
    assert "unknown" in hot_format_ok(ExpertGeometry("int4-amx", 64, 4, 64, 128, 1, (0,)), "fp4")


def test_marlin_slot_bytes_match_the_plan():
    """What HotExpertStore allocates per slot is what hot_expert_nbytes promised."""
    from types import SimpleNamespace

    from ktlayouts.families import SILU
    from ktrun.experts.hot_store import HotExpertStore

    conv = SimpleNamespace(geometry=ExpertGeometry("int4-amx", 128, 4, 256, 160, 1, (1,)), experts={1: []},
                           device=torch.device("cpu"), dtype=torch.float32,
                           config=SimpleNamespace(expert_activation=SILU))     # what the store reads of a conversion
    store = HotExpertStore(conv, {1: 2}, "marlin")
    got = sum(t.qweight.numel() * 4 + t.scales.numel() * 2 + 16 for t in store.slots[1][0])   # + weight_shape (2 x I64)
    assert got == hot_expert_nbytes(conv.geometry, "marlin") and store.nbytes == 2 * got
