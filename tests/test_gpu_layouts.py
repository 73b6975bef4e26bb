"""GPU layouts (gptq, marlin, compressed-tensors) against golden vectors from the public reference packers."""
import hashlib

import numpy as np
import pytest
from golden_data import GOLDEN, linear_entries
from ktlayouts import compressed_tensors as ct
from ktlayouts import gptq, marlin
from ktlayouts.cpu_expert import LayoutError

ENTRIES = linear_entries()


def _load(entry):
    d = np.load(GOLDEN / entry["file"])
    geom = gptq.GptqGeometry(entry["N"], entry["K"], entry["bits"], entry["group_size"])
    return d, geom


def test_goldens_cover_both_widths_and_all_group_sizes():
    assert {e["bits"] for e in ENTRIES} == {4, 8}
    assert {e["group_size"] for e in ENTRIES} == {32, 64, 128, -1}


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_gptq_golden_bytes(entry):
    d, geom = _load(entry)
    t = gptq.gptq_pack(d["codes_kn"], d["scales_fp16"], geom)
    assert t["qweight"].shape == geom.qweight_shape and t["qweight"].dtype == np.int32
    assert t["qweight"].tobytes() == d["gptq_qweight"].tobytes()
    assert t["qzeros"].tobytes() == d["gptq_qzeros_v1"].tobytes()
    assert t["scales"].tobytes() == d["scales_fp16"].tobytes()
    codes, scales, g_idx = gptq.gptq_unpack(t, geom)
    assert np.array_equal(codes, d["codes_kn"]) and np.array_equal(scales, d["scales_fp16"])
    assert np.array_equal(g_idx, np.arange(geom.k) // geom.group)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_marlin_golden_bytes(entry):
    d, geom = _load(entry)
    t = marlin.marlin_pack(d["codes_kn"], d["scales_fp16"], geom, name=entry["file"])
    assert t["qweight"].shape == d["marlin_qweight"].shape and t["qweight"].dtype == np.int32
    assert t["qweight"].tobytes() == d["marlin_qweight"].tobytes()
    assert hashlib.sha256(t["qweight"].tobytes()).hexdigest() == entry["marlin_sha256"]
    assert t["scales"].tobytes() == d["marlin_scales"].tobytes()
    codes, scales = marlin.marlin_unpack(t, geom)
    assert np.array_equal(codes, d["codes_kn"]) and np.array_equal(scales, d["scales_fp16"])


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_compressed_tensors_golden_bytes(entry):
    d, geom = _load(entry)
    t = ct.ct_pack(d["codes_kn"], d["scales_fp16"], geom)
    assert t["weight_packed"].tobytes() == d["ct_weight_packed"].tobytes()
    assert t["weight_scale"].tobytes() == d["ct_weight_scale"].tobytes()
    assert t["weight_shape"].tolist() == [geom.n, geom.k]
    codes, scales = ct.ct_unpack(t, geom)
    assert np.array_equal(codes, d["codes_kn"]) and np.array_equal(scales, d["scales_fp16"])


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_golden_dequantization_matches_reference_formula(entry):
    d, geom = _load(entry)
    w = gptq.dequantize_kn(d["codes_kn"], d["scales_fp16"], geom.default_g_idx(), geom.bits)
    ref = (d["codes_kn"].astype(np.float32) - 2 ** (geom.bits - 1)) * np.repeat(
        d["scales_fp16"].astype(np.float32), geom.group, axis=0)
    assert np.array_equal(w, ref.T)
    # the golden codes are a faithful quantization of the weight: error within half a step
    err = np.abs(w - d["weight_fp16"].astype(np.float32))
    step = np.repeat(d["scales_fp16"].astype(np.float32), geom.group, axis=0).T
    assert np.all(err <= 0.5 * step + 1e-3)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("kn", [(128, 64), (256, 192), (384, 128)])
def test_random_round_trips(bits, group_size, kn):
    k, n = kn
    geom = gptq.GptqGeometry(n, k, bits, group_size)
    rng = np.random.default_rng(bits * 1000 + k + n)
    codes = rng.integers(0, 2 ** bits, size=(k, n), dtype=np.uint8)
    scales = rng.standard_normal(geom.scales_shape).astype(np.float16)
    c, s, _ = gptq.gptq_unpack(gptq.gptq_pack(codes, scales, geom), geom)
    assert np.array_equal(c, codes) and np.array_equal(s, scales)
    c, s = marlin.marlin_unpack(marlin.marlin_pack(codes, scales, geom), geom)
    assert np.array_equal(c, codes) and np.array_equal(s, scales)
    c, s = ct.ct_unpack(ct.ct_pack(codes, scales, geom), geom)
    assert np.array_equal(c, codes) and np.array_equal(s, scales)


def test_weight_perm_is_a_permutation():
    for bits in (4, 8):
        assert sorted(marlin.weight_perm(bits).tolist()) == list(range(1024))
    grouped, single = marlin.scale_perms()
    assert sorted(grouped.tolist()) == list(range(64)) and sorted(single.tolist()) == list(range(32))


@pytest.mark.parametrize("n,k,msg", [(96, 256, "N=96"), (128, 200, "K=200"), (128, 64, "K=64")])
def test_marlin_rejects_untileable_shape_naming_the_tensor(n, k, msg):
    geom = gptq.GptqGeometry(n, k, 4, -1)
    codes = np.zeros((k, n), np.uint8)
    with pytest.raises(LayoutError, match=rf"model\.layers\.3\.self_attn\.o_proj\.weight.*{msg}"):
        marlin.marlin_pack(codes, np.zeros(geom.scales_shape, np.float16), geom,
                           name="model.layers.3.self_attn.o_proj.weight")


def test_marlin_padded_shape():
    assert marlin.marlin_padded_shape(96, 200, 128) == (128, 256)
    assert marlin.marlin_padded_shape(576, 7168, 128) == (576, 7168)
    assert marlin.marlin_padded_shape(64, 64, 32) == (64, 128)


def test_bad_packing_inputs():
    with pytest.raises(LayoutError, match="4 or 8 bits"):
        gptq.GptqGeometry(64, 128, 3, 128)
    with pytest.raises(LayoutError, match="group size"):
        gptq.GptqGeometry(64, 128, 4, 48)
    with pytest.raises(LayoutError, match="does not fit in 4 bits"):
        gptq.pack_rows(np.full((8, 2), 16, np.uint8), 4)
    geom = gptq.GptqGeometry(64, 128, 4, 128)
    t = gptq.gptq_pack(np.zeros((128, 64), np.uint8), np.zeros((1, 64), np.float16), geom)
    t["qzeros"] = gptq.pack_cols(np.full((1, 64), 3, np.uint8), 4)
    with pytest.raises(LayoutError, match="zero point"):
        gptq.gptq_unpack(t, geom)
