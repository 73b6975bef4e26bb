"""Golden bytes of our own CPU expert layouts (layouts/golden/, written once by layouts/write_golden.py):
today's pack must reproduce them byte for byte, unpack must read them back, they follow layouts/README.md's tile
formula (an independent loop here, not the packer), and every layout's current version must have them -- so a
change to pack and unpack together cannot keep the layout version and silently break every file on disk."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from ktlayouts.bf16 import bf16_bits_to_f32
from ktlayouts.constants import CPU_EXPERT_LAYOUTS, ZERO_POINT
from ktlayouts.cpu_expert import (
    MatrixGeometry,
    pack_codes,
    pack_expert_matrix,
    pack_scales,
    quantize,
    unpack_codes,
    unpack_expert_matrix,
    unpack_scales,
)
from ktlayouts.write_golden import written_versions

GOLDEN = Path(__file__).resolve().parents[1] / "layouts" / "golden"
INDEX = json.loads((GOLDEN / "index.json").read_text())["files"]


def _scale_dtype(e):
    return e.get("scale_dtype", "f32")      # version-1 entries predate the field: float32


# every version this code still writes: int layouts version 1 (float32 scales), 2 (float16 / bfloat16) and 3 (two-level,
# int4 group 32), bf16 its one
CURRENT = [e for e in INDEX if e["layout"] in CPU_EXPERT_LAYOUTS
           and any(e["layout_version"] == v for v, _ in written_versions(e["layout"]))]
INT = [e for e in CURRENT if e["bits"] != 16]
INT_F32 = [e for e in INT if _scale_dtype(e) == "f32"]
INT_16 = [e for e in INT if _scale_dtype(e) in ("f16", "bf16")]
INT_SUB6 = [e for e in INT if _scale_dtype(e) == "sub6"]
BF16 = [e for e in CURRENT if e["bits"] == 16]


def _ids(e):
    return e["file"]


def _load(e):
    return np.load(GOLDEN / e["file"]), MatrixGeometry(e["n"], e["k"], e["bits"], e["group_size"],
                                                       _scale_dtype(e) if e["bits"] != 16 else "f32")


def test_index_lists_existing_files_with_their_sha256_and_they_stay_small():
    listed = {e["file"] for e in INDEX}
    on_disk = {p.name for p in GOLDEN.glob("*.npz")}
    assert listed == on_disk
    for e in INDEX:
        assert hashlib.sha256((GOLDEN / e["file"]).read_bytes()).hexdigest() == e["sha256"], e["file"]
    assert sum((GOLDEN / f).stat().st_size for f in listed) < 1 << 20


@pytest.mark.parametrize("layout", sorted(CPU_EXPERT_LAYOUTS))
def test_every_current_layout_version_has_golden_files(layout):
    """Bumping a version in ktlayouts.constants.CPU_EXPERT_LAYOUTS needs new golden files for it."""
    bits, version = CPU_EXPERT_LAYOUTS[layout]
    mine = [e for e in CURRENT if e["layout"] == layout]
    assert mine, (f"{layout} version {version} has no golden files in {GOLDEN}: run "
                  "layouts/write_golden.py once for the new version (see layouts/README.md)")
    assert all(e["bits"] == bits for e in mine)
    geoms = [MatrixGeometry(e["n"], e["k"], bits, e["group_size"]) for e in mine]
    assert any(g.n_pad != g.n for g in geoms) and any(g.k_pad != g.k for g in geoms), "a padded shape is missing"
    if bits != 16:
        assert {e["group_size"] for e in mine} == {32, 64, 128, -1}


@pytest.mark.parametrize("entry", INT_F32, ids=_ids)
def test_bf16_scales_off_is_the_golden_path_and_on_rounds_only_the_scales(entry):
    """quantize(..., bf16_scales) (`ktconvert quantize --bf16-scales`): off reproduces the golden bytes; on, every
    scale is the bf16 rounding of the golden one and the codes stay within one step of it."""
    d, geom = _load(entry)
    w = d["weight"].astype(np.float32)
    qweight, packed = pack_expert_matrix(w, geom, bf16_scales=False)
    assert qweight.tobytes() == d["qweight"].tobytes() and packed.tobytes() == d["packed_scales"].tobytes()
    codes, scales = quantize(w, geom, bf16_scales=True)
    want = torch.from_numpy(d["scales"]).to(torch.bfloat16).float().numpy()      # torch's rounding, not ours
    assert np.array_equal(scales, want)
    assert np.abs(codes.astype(np.int16) - d["codes"].astype(np.int16)).max() <= 1


@pytest.mark.parametrize("entry", INT, ids=_ids)
def test_int_pack_reproduces_the_golden_bytes(entry):
    d, geom = _load(entry)
    codes, scales = quantize(d["weight"].astype(np.float32), geom)
    assert codes.tobytes() == d["codes"].tobytes() and scales.tobytes() == d["scales"].tobytes()
    qweight, packed = pack_expert_matrix(d["weight"].astype(np.float32), geom)
    assert qweight.shape == geom.qweight_shape and qweight.dtype == np.uint8
    assert qweight.tobytes() == d["qweight"].tobytes()
    assert packed.tobytes() == d["packed_scales"].tobytes()
    assert pack_codes(d["codes"], geom).tobytes() == d["qweight"].tobytes()
    assert pack_scales(d["scales"], geom).tobytes() == d["packed_scales"].tobytes()


@pytest.mark.parametrize("entry", INT, ids=_ids)
def test_int_unpack_reads_the_golden_bytes(entry):
    d, geom = _load(entry)
    assert np.array_equal(unpack_codes(d["qweight"], geom), d["codes"])
    assert np.array_equal(unpack_scales(d["packed_scales"], geom), d["scales"])
    # W[n, k] = (code[n, k] - Z) * scale[n, k // G]  (README), cropped to the logical (N, K)
    want = (d["codes"].astype(np.float32) - ZERO_POINT[geom.bits]) * np.repeat(d["scales"], geom.group, axis=1)
    got = unpack_expert_matrix(d["qweight"], d["packed_scales"], geom)
    assert np.array_equal(got, want[: geom.n, : geom.k])
    # and the codes are a faithful quantization of the stored weight: within half a step (one step where the
    # opposite of the group's peak clips to the top code; two-level scales d * q may sit below the group's peak
    # scale, so there values may clip at either end code), padding is weight 0
    step = np.abs(np.repeat(d["scales"], geom.group, axis=1))[: geom.n, : geom.k]
    err = np.abs(got - d["weight"].astype(np.float32))
    c = d["codes"][: geom.n, : geom.k]
    clipped = ((c == 0) | (c == (1 << geom.bits) - 1)) if geom.scale_dtype == "sub6" else np.zeros_like(c, bool)
    assert np.all((err <= step * (1 + 1e-6)) | clipped) and np.mean(err <= 0.5 * step * (1 + 1e-6)) > 0.97
    assert np.all(want[geom.n:] == 0) and np.all(want[:, geom.k:] == 0)


@pytest.mark.parametrize("entry", BF16, ids=_ids)
def test_bf16_pack_and_unpack_reproduce_the_golden_bytes(entry):
    d, geom = _load(entry)
    q, scales = pack_expert_matrix(d["weight"], geom)
    assert scales is None and q.shape == geom.qweight_shape and q.tobytes() == d["qweight"].tobytes()
    full = bf16_bits_to_f32(d["bits"])
    assert np.array_equal(unpack_expert_matrix(d["qweight"], None, geom), full[: geom.n, : geom.k], equal_nan=True)
    # the stored rounding is torch's float32 -> bfloat16 (round to nearest, ties to even)
    ref = torch.from_numpy(d["weight"]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(d["bits"][: geom.n, : geom.k], ref)
    assert np.all(d["bits"][geom.n:] == 0) and np.all(d["bits"][:, geom.k:] == 0)


def _spec_int_tiles(codes: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """README: tile[nb, kt] row r, byte 4*n + j = code[16*nb + n, 64*kt + 4*r + j]; int4 packs rows 2c (low
    nibble) and 2c+1 (high nibble) into chunk c of 64 bytes."""
    out = np.zeros(geom.qweight_shape, dtype=np.uint8)
    for nb in range(geom.n_blocks):
        for kt in range(geom.k_tiles):
            rows = np.zeros((16, 64), dtype=np.uint8)
            for r in range(16):
                for n in range(16):
                    for j in range(4):
                        rows[r, 4 * n + j] = codes[16 * nb + n, 64 * kt + 4 * r + j]
            out[nb, kt] = (rows if geom.bits == 8 else rows[0::2] | (rows[1::2] << 4)).reshape(-1)
    return out


def _spec_bf16_tiles(bits: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """README: each tile 16 rows x 16 columns x 2 consecutive K values: element (r, n, j) = bf16[16nb + n,
    32kt + 2r + j], little-endian."""
    out = np.zeros((geom.n_blocks, geom.k_tiles, 16, 16, 2), dtype="<u2")
    for nb in range(geom.n_blocks):
        for kt in range(geom.k_tiles):
            for r in range(16):
                for n in range(16):
                    out[nb, kt, r, n] = bits[16 * nb + n, 32 * kt + 2 * r: 32 * kt + 2 * r + 2]
    return out.view(np.uint8).reshape(geom.qweight_shape)


@pytest.mark.parametrize("entry", CURRENT, ids=_ids)
def test_golden_bytes_follow_the_readme_tile_formula(entry):
    d, geom = _load(entry)
    if geom.bits == 16:
        assert d["qweight"].tobytes() == _spec_bf16_tiles(d["bits"], geom).tobytes()
        return
    assert d["qweight"].tobytes() == _spec_int_tiles(d["codes"], geom).tobytes()
    if geom.scale_dtype == "sub6":
        assert d["packed_scales"].tobytes() == _spec_sub6_records(d["super_scales"], d["sub_scales"], geom)
        return
    # scales: (NB, n_groups, 16), the 16 scales of a column block for one group together, in the stored dtype
    want = np.stack([d["scales"][16 * nb: 16 * nb + 16].T for nb in range(geom.n_blocks)])
    assert d["packed_scales"].tobytes() == _torch_bytes(want, geom.scale_dtype)


def _spec_sub6_records(dsup: np.ndarray, q: np.ndarray, geom: MatrixGeometry) -> bytes:
    """README: per column block nb and super-block j a 128-byte record: ql[16 g' + c] = low nibble u(g', c) | low
    nibble u(g' + 4, c) << 4 (g' < 4), then the 16 d as float16 (torch's bytes), then qh[16 h + c] = sum_i bits 4-5
    of u(4 h + i, c) << 2 i, u = q mod 64; groups g = 8 j + g', columns 16 nb + c."""
    out = bytearray()
    for nb in range(geom.n_blocks):
        for j in range(geom.n_groups // 8):
            u = [[int(q[16 * nb + c, 8 * j + g]) % 64 for c in range(16)] for g in range(8)]
            ql = bytes((u[g][c] & 15) | ((u[g + 4][c] & 15) << 4) for g in range(4) for c in range(16))
            qh = bytes(sum(((u[4 * h + i][c] >> 4) & 3) << (2 * i) for i in range(4)) for h in range(2) for c in range(16))
            dd = torch.tensor([float(dsup[16 * nb + c, j]) for c in range(16)]).to(torch.float16).numpy().tobytes()
            out += ql + dd + qh
    return bytes(out)


TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _torch_bytes(a: np.ndarray, scale_dtype: str) -> bytes:
    """float32 values -> their bytes in `scale_dtype`, rounded by torch (not by ktlayouts)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(TORCH_DTYPES[scale_dtype]).numpy(
        ).tobytes() if scale_dtype != "bf16" else torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(
        torch.bfloat16).view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("layout", sorted(CPU_EXPERT_LAYOUTS))
def test_every_written_version_and_scale_dtype_has_golden_files(layout):
    """Version 1 (float32 scales) is still written next to version 2 (float16 / bfloat16): all keep golden files."""
    for version, dtypes in written_versions(layout):
        for sd in dtypes:
            mine = [e for e in CURRENT if e["layout"] == layout and e["layout_version"] == version
                    and (e["bits"] == 16 or _scale_dtype(e) == sd)]
            assert mine, f"{layout} version {version} ({sd} scales) has no golden files: run python -m ktlayouts.write_golden"
            if CPU_EXPERT_LAYOUTS[layout][0] != 16:
                assert {e["group_size"] for e in mine} == ({32} if sd == "sub6" else {32, 64, 128, -1})


def _v1_twin(e):
    twin = [f for f in INDEX if f["layout"] == e["layout"] and f["layout_version"] == 1 and
            (f["n"], f["k"], f["group_size"]) == (e["n"], e["k"], e["group_size"])]
    assert len(twin) == 1, e["file"]
    return np.load(GOLDEN / twin[0]["file"])


@pytest.mark.parametrize("entry", INT_16, ids=_ids)
def test_16bit_scales_are_the_rounded_reference_rule_and_codes_follow_them(entry):
    """Version 2 against an independent reference: its scales are torch's rounding of version 1's float32 scales
    (the reference rule, largest magnitude onto -2^(b-1), unchanged), and the codes are round-to-nearest of the
    same weights against those rounded scales, clipped to the code range (layouts/README.md)."""
    d, geom = _load(entry)
    v1 = _v1_twin(entry)
    assert np.array_equal(d["weight"], v1["weight"])
    want = torch.from_numpy(v1["scales"]).to(TORCH_DTYPES[geom.scale_dtype]).float().numpy()
    assert np.array_equal(d["scales"], want)
    qmin, z = -(1 << (geom.bits - 1)), ZERO_POINT[geom.bits]
    w = np.zeros((geom.n_pad, geom.k_pad), np.float64)
    w[: geom.n, : geom.k] = d["weight"]
    s = np.repeat(want.astype(np.float64), geom.group, axis=1)
    q = np.clip(np.rint(np.divide(w, s, out=np.zeros_like(w), where=s != 0)), qmin, -qmin - 1) + z
    # float32 1/scale in the packer vs float64 division here: a code may differ at an exact tie only
    diff = np.abs(q - d["codes"].astype(np.float64))
    assert diff.max() <= 1 and np.mean(diff == 0) > 0.999
    assert np.abs(d["codes"].astype(np.int16) - v1["codes"].astype(np.int16)).max() <= 1
    # what goes on disk: 2 bytes a scale
    assert d["packed_scales"].nbytes == geom.scales_nbytes == geom.n_blocks * geom.n_groups * 16 * 2


@pytest.mark.parametrize("entry", [e for e in INT_16 if _scale_dtype(e) == "bf16"], ids=_ids)
def test_bf16_scales_on_bf16_storage_is_the_golden_path(entry):
    """--bf16-scales with --scale-dtype bf16: the scales already are bf16 values, nothing changes."""
    d, geom = _load(entry)
    qweight, packed = pack_expert_matrix(d["weight"].astype(np.float32), geom, bf16_scales=True)
    assert qweight.tobytes() == d["qweight"].tobytes() and packed.tobytes() == d["packed_scales"].tobytes()


@pytest.mark.parametrize("entry", INT_SUB6, ids=_ids)
def test_two_level_scales_are_the_rule_on_version_1_scales_and_codes_follow_them(entry):
    """Version 3 (sub6) against an independent reference: per row and super-block of 8 groups, d = max |s| / 31 (s:
    version 1's reference-rule scales) rounded to 6 significant bits (here by log2 and a power-of-two step) and to
    float16 (torch), every scale d * q with q = clip(rint(s / d), -32, 31), every product a float16 value (exact in
    Marlin's scales); the stored decomposition multiplies out to them; the codes are round-to-nearest against d * q,
    and the records take 1 byte per (column, group)."""
    d, geom = _load(entry)
    v1 = _v1_twin(entry)
    assert np.array_equal(d["weight"], v1["weight"])
    s1 = np.zeros((geom.n_pad, geom.n_groups))                  # version 1 pads K less (lcm(64, G), not 256)
    s1[:, : v1["scales"].shape[1]] = v1["scales"]
    s1 = s1.reshape(geom.n_pad, -1, 8)
    amax = np.abs(s1).max(axis=2) / 31
    step = 2.0 ** (np.floor(np.log2(np.where(amax > 0, amax, 1))) - 5)
    d_rule = torch.from_numpy(np.rint(amax / step) * step).to(torch.float16).double().numpy()
    q_rule = np.clip(np.rint(np.divide(s1, d_rule[..., None], out=np.zeros_like(s1), where=d_rule[..., None] != 0)),
                     -32, 31)
    scales = (d_rule[..., None] * q_rule).reshape(geom.n_pad, geom.n_groups)
    assert np.array_equal(d["scales"].astype(np.float64), scales)
    dsup, q = d["super_scales"].astype(np.float64), d["sub_scales"].astype(np.float64)
    assert np.array_equal(np.repeat(dsup, 8, axis=1) * q, scales) and q.min() >= -32 and q.max() <= 31
    assert np.array_equal(torch.from_numpy(scales).to(torch.float16).double().numpy(), scales)
    w = np.zeros((geom.n_pad, geom.k_pad), np.float64)
    w[: geom.n, : geom.k] = d["weight"]
    s = np.repeat(scales, geom.group, axis=1)
    codes = np.clip(np.rint(np.divide(w, s, out=np.zeros_like(w), where=s != 0)), -8, 7) + 8
    diff = np.abs(codes - d["codes"].astype(np.float64))
    assert diff.max() <= 1 and np.mean(diff == 0) > 0.999
    assert d["packed_scales"].nbytes == geom.scales_nbytes == geom.n_blocks * geom.n_groups * 16
