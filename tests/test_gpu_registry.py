"""The GPU Linear format registry (ktlayouts.gpu_formats): every registered format packs and unpacks losslessly,
matches the stored shapes it announces, dequantizes the public reference packers' golden bytes
(tests/golden) to the reference formula, and names a bad layout name."""
import json

import numpy as np
import pytest
from golden_data import GOLDEN, linear_entries
from ktlayouts.cpu_expert import LayoutError
from ktlayouts.gptq import GptqGeometry
from ktlayouts.gpu_formats import (
    format_families,
    gpu_format,
    gpu_format_for,
    gpu_layouts,
    is_gpu_layout,
    layout_name,
    quantized_linears,
)

from ktconvert.gpu.options import GPU_FORMATS

ENTRIES = linear_entries()
# the golden arrays holding each family's parts (the rest of a family's parts: weight_shape, derived)
GOLDEN_PARTS = {
    "marlin": {"qweight": "marlin_qweight", "scales": "marlin_scales"},
    "gptq": {"qweight": "gptq_qweight", "qzeros": "gptq_qzeros_v1", "scales": "scales_fp16"},
    "compressed-tensors": {"weight_packed": "ct_weight_packed", "weight_scale": "ct_weight_scale"},
}
FORMATS = [gpu_format(name) for name in gpu_layouts()]
NP_DTYPE = {"I32": np.int32, "F16": np.float16, "F32": np.float32, "I64": np.int64}


def test_registry_holds_every_family_at_both_widths_and_the_cli_offers_them():
    assert format_families() == ("marlin", "gptq", "compressed-tensors")
    assert GPU_FORMATS == format_families()
    assert set(gpu_layouts()) == {f"gpu-{f}-int{b}" for f in format_families() for b in (4, 8)}
    for fmt in FORMATS:
        assert gpu_format(fmt.name) is fmt and layout_name(fmt.family, fmt.bits) == fmt.name
        assert gpu_format_for(fmt.family, fmt.bits) is fmt and is_gpu_layout(fmt.name)


@pytest.mark.parametrize("bad", ["gpu-awq-int4", "gpu-marlin-int3", "gpu-marlin", "marlin", "dense-bf16", ""])
def test_bad_layout_names_are_named_in_the_error(bad):
    assert not is_gpu_layout(bad)
    with pytest.raises(LayoutError, match=f"'{bad}' is not a GPU-layer layout"):
        gpu_format(bad)


def test_bad_family_or_bits_are_named():
    with pytest.raises(LayoutError, match="'awq'"):
        gpu_format_for("awq", 4)
    with pytest.raises(LayoutError, match="4 or 8 bits, got 3"):
        gpu_format_for("gptq", 3)


def _random(geom: GptqGeometry, seed: int):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2 ** geom.bits, size=(geom.k, geom.n), dtype=np.uint8)
    scales = rng.standard_normal(geom.scales_shape).astype(np.float16)
    return codes, scales


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("nk", [(128, 256), (64, 384)])
def test_pack_unpack_round_trip_and_announced_part_shapes(fmt, group_size, nk):
    n, k = nk
    geom = fmt.storage_geometry(n, k, group_size)
    codes, scales = _random(geom, fmt.bits + n + k + group_size)
    g_idx = None
    if fmt.stores_g_idx:                              # act order: any group order survives
        g_idx = np.random.default_rng(0).permutation(geom.default_g_idx()).astype(np.int32)
    parts = fmt.pack(codes, scales, geom, g_idx=g_idx, name="x.weight")
    assert [(s, a.dtype, a.shape) for s, a in parts.items()] == [
        (s, NP_DTYPE[dt], shape) for s, dt, shape in fmt.part_shapes(geom)]
    assert tuple(parts) == fmt.suffixes
    u = fmt.unpack(parts)
    assert np.array_equal(u.codes_kn, codes) and np.array_equal(u.scales_gn, scales)
    assert np.array_equal(u.g_idx, geom.default_g_idx() if g_idx is None else g_idx)
    assert u.geom == geom and u.shape == (n, k)
    want = ((codes.astype(np.float32) - 2 ** (fmt.bits - 1)) * scales.astype(np.float32)[u.g_idx]).T
    assert np.array_equal(fmt.dequantize(parts), want)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_padding_formats_crop_to_the_logical_shape_and_others_refuse_it(fmt):
    n, k = 96, 200                                    # neither tiles Marlin (N % 64, K % 128)
    if not fmt.pads:
        with pytest.raises(LayoutError, match="K=200"):
            fmt.storage_geometry(n, k, 128)
        geom = fmt.storage_geometry(128, 256, 128)
        codes, scales = _random(geom, 1)
        with pytest.raises(LayoutError, match="x.weight: logical shape"):
            fmt.pack(codes, scales, geom, shape=(n, k), name="x.weight")
        return
    geom = fmt.storage_geometry(n, k, 128)
    assert (geom.n, geom.k) == (128, 256)
    codes, scales = _random(geom, 2)
    parts = fmt.pack(codes, scales, geom, shape=(n, k), name="x.weight")
    assert parts["weight_shape"].tolist() == [n, k] and fmt.unpack(parts).shape == (n, k)
    full = ((codes.astype(np.float32) - 2 ** (fmt.bits - 1)) * np.repeat(scales.astype(np.float32), 128, axis=0)).T
    assert np.array_equal(fmt.dequantize(parts), full[:n, :k])


@pytest.mark.parametrize("fmt", [f for f in FORMATS if not f.stores_g_idx], ids=lambda f: f.name)
def test_formats_without_g_idx_refuse_a_permuted_group_order(fmt):
    geom = fmt.storage_geometry(128, 256, 64)
    codes, scales = _random(geom, 3)
    with pytest.raises(LayoutError, match="x.weight: .* has no g_idx"):
        fmt.pack(codes, scales, geom, g_idx=geom.default_g_idx()[::-1].copy(), name="x.weight")
    fmt.pack(codes, scales, geom, g_idx=geom.default_g_idx(), name="x.weight")       # the plain order is fine


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.quant_method], ids=lambda f: f.name)
def test_float32_scales_stay_exact(fmt):
    geom = fmt.storage_geometry(128, 256, 32)
    codes = _random(geom, 4)[0]
    scales = np.random.default_rng(5).standard_normal(geom.scales_shape).astype(np.float32)
    u = fmt.unpack(fmt.pack(codes, scales, geom, scale_dtype=np.float32))
    assert u.scales_gn.dtype == np.float32 and np.array_equal(u.scales_gn, scales)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_scale_part_is_the_part_that_holds_the_scales(fmt):
    geom = fmt.storage_geometry(128, 256, 32)
    codes = _random(geom, 6)[0]
    scales = np.random.default_rng(7).standard_normal(geom.scales_shape).astype(np.float16)
    parts = fmt.pack(codes, scales, geom)
    assert fmt.scale_part in fmt.suffixes
    assert sorted(parts[fmt.scale_part].reshape(-1).tolist()) == sorted(scales.reshape(-1).tolist())


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
@pytest.mark.parametrize("family", sorted(GOLDEN_PARTS))
def test_dequantize_golden_bytes_to_the_reference_formula(entry, family):
    """The reference packers' bytes (vLLM's Marlin/GPTQ, compressed-tensors) read through the registry."""
    d = np.load(GOLDEN / entry["file"])
    fmt = gpu_format(layout_name(family, entry["bits"]))
    n, k = entry["N"], entry["K"]
    parts = {suffix: d[key] for suffix, key in GOLDEN_PARTS[family].items()}
    if "weight_shape" in fmt.suffixes:
        parts["weight_shape"] = np.array([n, k], dtype=np.int64)
    group = k if entry["group_size"] == -1 else entry["group_size"]
    ref = ((d["codes_kn"].astype(np.float32) - 2 ** (entry["bits"] - 1))
           * np.repeat(d["scales_fp16"].astype(np.float32), group, axis=0)).T
    assert np.array_equal(fmt.dequantize(parts, what=entry["file"]), ref)
    # and packing the golden codes through the registry gives the reference bytes back
    geom = fmt.storage_geometry(n, k, entry["group_size"])
    ours = fmt.pack(d["codes_kn"], d["scales_fp16"], geom, shape=(n, k))
    for suffix, key in GOLDEN_PARTS[family].items():
        assert ours[suffix].tobytes() == d[key].tobytes(), suffix


def test_missing_parts_are_named():
    fmt = gpu_format("gpu-compressed-tensors-int4")
    with pytest.raises(LayoutError, match=r"model\.x\.weight: gpu-compressed-tensors-int4 needs tensors \['weight_scale'"):
        fmt.dequantize({"weight_packed": np.zeros((64, 16), np.int32)}, what="model.x.weight")


def test_quantized_linears_find_each_linear_by_its_first_part():
    layouts, names = {}, []
    for i, fmt in enumerate(FORMATS):
        for suffix in fmt.suffixes:
            names.append(f"l{i}.{suffix}")
            layouts[f"l{i}.{suffix}"] = fmt.name
    names.append("norm.weight")
    layouts["norm.weight"] = "dense-bf16"
    assert quantized_linears(names, layouts) == {f"l{i}.weight": fmt.name for i, fmt in enumerate(FORMATS)}


def test_quantization_configs_exist_where_an_engine_reads_the_family():
    for fmt in FORMATS:
        qc = fmt.quantization_config(128)
        if fmt.quant_method is None:
            assert qc is None
            with pytest.raises(LayoutError, match="no quantization_config"):
                fmt.with_scheme({}, r".*\.experts\..*", 4, 32)
            continue
        assert qc["quant_method"] == fmt.quant_method
        skip = fmt.with_unquantized(qc, ["model.layers.0.mlp.gate"], [r".*\.experts($|\..*)"])
        assert skip != qc and fmt.with_unquantized(skip, ["model.layers.0.mlp.gate"]) == skip       # idempotent
        two = fmt.with_scheme(qc, r".*\.experts\.\d+\.[^.]+$", 8, -1)
        assert json.dumps(two) != json.dumps(qc) and fmt.quantization_config(128) == qc        # copies, not edits
