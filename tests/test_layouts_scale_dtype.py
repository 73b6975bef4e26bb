"""Expert scales in 16 bits (cpu-expert-int4/int8 layout version 2, float16 or bfloat16) next to float32 (version 1):
what is written, that version-1 directories (including manifests written before version 2 existed) keep loading
and give the same numbers, and the exact take-over rules (GGUF Q8_0's float16 scales; bfloat16 scales of
already-quantized sources inside float16's range).

References: numpy's float16 / the bf16 bit patterns of ktlayouts, gguf-py's dequantizer (the Q8_0 file), and the
version-1 conversion itself (a v1 directory must read back exactly as it did)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ktlayouts.constants import CPU_EXPERT_LAYOUTS
from ktlayouts.converted_dir import ManifestError, load_manifest
from ktlayouts.cpu_expert import (
    LayoutError,
    MatrixGeometry,
    bf16_bits_to_f32,
    pack_expert_codes,
    pack_expert_matrix,
    round_scales,
    scales_representable,
    unpack_expert_matrix,
)
from safetensors import safe_open

from ktconvert.converted_reader import ConvertedDir
from ktconvert.pipeline import ConvertOptions, convert


def test_16_bit_scales_round_trip_and_size():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((40, 200)) * 0.02).astype(np.float32)
    for sd, dtype, nbytes in (("f32", np.float32, 4), ("f16", np.float16, 2), ("bf16", np.uint16, 2)):
        geom = MatrixGeometry(40, 200, 4, 32, scale_dtype=sd)
        q, s = pack_expert_matrix(w, geom)
        assert s.dtype == dtype and s.shape == geom.scales_shape and s.nbytes == geom.scales_nbytes
        assert geom.scales_nbytes == geom.n_blocks * geom.n_groups * 16 * nbytes
        deq = unpack_expert_matrix(q, s, geom)
        # the reference rule with the stored (rounded) scale: half a step, or one step where the other sign's extreme
        # is clipped at +7 (the largest magnitude sits on -8), plus the scale's rounding (bf16: 2^-9 of 8 steps)
        step = np.abs(np.pad(w, ((0, 0), (0, geom.k_pad - 200))).reshape(40, -1, 32)).max(-1) / 8
        step = np.repeat(step, 32, axis=1)[:, :200]
        err = np.abs(deq - w)
        assert np.all(err <= step * (1 + 8 * 2.0 ** -8) + 1e-7), sd
        assert np.mean(err <= step * (0.5 + 8 * 2.0 ** -8) + 1e-7) > 0.97, sd


def test_bf16_scales_inside_float16_range_are_exact_in_float16():
    """Why float16 and not bfloat16 for version 2: every bfloat16 value whose exponent float16 can represent
    (2^-17 .. 65280, i.e. all realistic weight scales) is a float16 value, so sources with bfloat16 scales (Kimi's
    compressed-tensors INT4, kt-kernel's RAWINT4 export) are taken over exactly, while float16 keeps 3 more
    mantissa bits for our own scales (and GGUF's float16 Q8_0/Q4_0 scales exactly)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    v = bf16_bits_to_f32(bits)
    finite = np.isfinite(v)
    exp = (bits.astype(np.int32) >> 7) & 0xFF
    inside = finite & (exp >= 127 - 17) & (np.abs(v) <= 65504) | (v == 0)
    assert np.array_equal(v[inside].astype(np.float16).astype(np.float32), v[inside])
    assert scales_representable(v[inside], "f16")
    assert not scales_representable(np.float32([(1 + 2.0 ** -7) * 2.0 ** -20]), "f16")   # a bf16 value below 2^-17
    assert np.array_equal(round_scales(v[inside], "bf16"), v[inside])
    # float16 values are not all bfloat16 values: GGUF's float16 scales need float16 to be taken over exactly
    f16 = np.float32([1.0 + 2 ** -10, 0.0123]).astype(np.float16).astype(np.float32)
    assert scales_representable(f16, "f16") and not scales_representable(f16, "bf16")
    geom = MatrixGeometry(16, 64, 8, 32, scale_dtype="bf16")
    with pytest.raises(LayoutError, match="not exactly representable as bf16"):
        pack_expert_codes(np.full((16, 64), 128, np.uint8), np.full((16, 2), f16[0], np.float32), geom)


@pytest.fixture(scope="module")
def conversions(ckpt_dir, tmp_path_factory):
    src = ckpt_dir("deepseek_v3")
    root = tmp_path_factory.mktemp("sd")
    out = {}
    for sd in ("f32", "f16", "bf16"):
        convert(src, root / sd, ConvertOptions(method="int4-amx", group_size=32, numa_nodes=2, scale_dtype=sd,
                                               expert_quantizer="rtn"), show_progress=False)
        out[sd] = root / sd
    return src, out


def test_versions_and_dtypes_written(conversions):
    _, out = conversions
    for sd, version, dtype in (("f32", 1, "F32"), ("f16", 2, "F16"), ("bf16", 2, "BF16")):
        m, geo = load_manifest(out[sd])
        assert m["experts"]["layout_version"] == version and geo.scale_dtype == sd
        rel = next(r for r in m["files"] if r.startswith("experts/"))
        assert m["files"][rel]["tensors"]["down.scales"]["dtype"] == dtype
        with safe_open(str(out[sd] / rel), framework="pt") as h:
            assert h.metadata()["kt.layout_version"] == str(version)
    assert CPU_EXPERT_LAYOUTS["cpu-expert-int4"][1] == 2      # the newest version this code writes


def test_version_1_directories_keep_loading_with_the_same_numbers(conversions, tmp_path):
    """A version-1 manifest as the previous release wrote it (no experts.scale_dtype) loads in ktconvert's reader and
    in ktrun (kernels and reference), and the 16-bit conversions give the v1 numbers within their scale rounding."""
    import shutil

    from ktrun.engine import Engine
    from ktrun.models.kv_cache import Batch

    _, out = conversions
    old = tmp_path / "v1"
    shutil.copytree(out["f32"], old)
    m = json.loads((old / "manifest.json").read_text())
    del m["experts"]["scale_dtype"]
    (old / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    _, geo = load_manifest(old)
    assert geo.scale_dtype == "f32" and geo.layout_version == 1
    layer = geo.moe_layers[0]
    ref = ConvertedDir(out["f32"]).read_expert(layer, 3)
    for name, d in (("v1", old), ("f16", out["f16"]), ("bf16", out["bf16"])):
        got = ConvertedDir(d).read_expert(layer, 3)
        for p in ("gate", "up", "down"):
            tol = 0 if name == "v1" else (2e-2 if name == "bf16" else 3e-3)
            assert np.abs(got[p] - ref[p]).max() <= tol * np.abs(ref[p]).max(), (name, p)
    ids = list(range(5, 69))
    logits = {}
    for name, d in (("v1", old), ("f32", out["f32"]), ("f16", out["f16"]), ("bf16", out["bf16"])):
        for kernels in (True, False):
            eng = Engine(d, ctx=128, use_kernels=kernels)
            try:
                logits[name, kernels] = eng.model.forward(Batch.build([(eng.model.new_cache(128), ids)], "cpu"),
                                                          all_logits=True)
            finally:
                eng.close()
    assert torch.equal(logits["v1", True], logits["f32", True]) and torch.equal(logits["v1", False], logits["f32", False])
    for sd in ("f16", "bf16"):
        lp, lq = torch.log_softmax(logits["f32", True], -1), torch.log_softmax(logits[sd, True], -1)
        assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 1e-3, sd


def test_unknown_layout_version_is_refused(conversions, tmp_path):
    import shutil

    _, out = conversions
    d = tmp_path / "v9"
    shutil.copytree(out["f16"], d)
    m = json.loads((d / "manifest.json").read_text())
    m["experts"]["layout_version"] = 9
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="layout_version.*9.*upgrade"):
        load_manifest(d)


def test_q8_0_take_over_stays_exact_with_float16_scales(ckpt_dir, tmp_path):
    """GGUF Q8_0 blocks (float16 scales) -> int8 group 32 with version-2 float16 scales: codes and scales taken over,
    bit-exact against gguf-py; with bfloat16 scales the converter quantizes from floats instead (not exact)."""
    import subprocess
    import sys

    import gguf
    from gguf_export import Q, export_gguf

    path = export_gguf(ckpt_dir("deepseek_v3"), tmp_path / "m-q8_0.gguf", Q.Q8_0)
    for sd, exact in (("f16", True), ("bf16", False)):
        out = tmp_path / sd
        r = subprocess.run([sys.executable, "-m", "ktconvert", "quantize", str(path), "-o", str(out), "--quiet",
                            "--method", "int8-amx", "--group-size", "32", "--scale-dtype", sd],
                           capture_output=True, text=True, timeout=600, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        # the experts' summary (GPU layers the default upgrades to int8 take Q8_0 over too, on their own line)
        experts = [ln for ln in r.stderr.splitlines() if ln.startswith("ktconvert: experts:")]
        assert len(experts) == 1 and ("no float round trip" in experts[0]) == exact, r.stderr[-2000:]
        conv = ConvertedDir(out)
        layer = conv.geometry.moe_layers[0]
        t = next(t for t in gguf.GGUFReader(path).tensors if t.name == f"blk.{layer}.ffn_down_exps.weight")
        want = gguf.quants.dequantize(np.asarray(t.data[2]), t.tensor_type)
        got = conv.read_expert(layer, 2)["down"]
        if exact:
            np.testing.assert_array_equal(got, want)
        else:
            assert 0 < np.abs(got - want).max() < 0.02 * np.abs(want).max()
