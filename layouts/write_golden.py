"""Write the golden files of the CPU expert layouts' CURRENT versions (ktlayouts.expert_formats' records) from
today's packer. Run once per layout version, by hand:

    .venv/bin/python -m ktlayouts.write_golden

It refuses to touch a (layout, version) that index.json already lists: golden bytes are written once and never
regenerated. Changing pack or unpack means bumping the layout's version in constants.py and running this again,
which adds files for the new version next to the old ones (tests/test_layouts_golden.py reads them; it never runs
this script).

Each file holds one (N, K) expert matrix:
  int layouts:  weight (N, K) float16 (packed as float32), codes (N_pad, K_pad) uint8, scales (N_pad, n_groups)
                float32 (quantize's output), qweight (NB, KT, TB) uint8 and packed_scales (NB, n_groups, 16) in the
                version's stored dtype (what goes on disk): float32 for version 1; float16, or bfloat16 as its uint16
                bits, for version 2 (one file per scale dtype, `scale_dtype` in the index); uint8 two-level records
                for version 3 (int4 group 32 only, `sub6`), whose files also hold the decomposition: super_scales
                (N_pad, n_groups / 8) float32 (float16 values) and sub_scales (N_pad, n_groups) int8. Every version
                uses the same weights (same seeds), so the tests can check a version against version 1's scales.
  bf16 layout:  weight (N, K) float32, bits (N_pad, K_pad) uint16 (the rounded, padded bf16 values), qweight
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from ktlayouts.bf16 import f32_to_bf16_bits
from ktlayouts.cpu_expert import (
    MatrixGeometry,
    pack_bf16,
    pack_codes,
    pack_scales,
    pad_weight,
    quantize,
    two_level_decompose,
)
from ktlayouts.expert_formats import (
    UNDECLARED_SCALE_DTYPE,
    LayoutError,
    expert_format,
    expert_formats,
    layout_records,
    layout_versions,
    scale_encoding,
)

HERE = Path(__file__).resolve().parent / "golden"
INDEX = HERE / "index.json"
INT_SHAPES = [(16, 256), (20, 136)]                 # (N, K): tile-aligned; N % 16 != 0 and K % unit != 0
BF16_SHAPES = [(16, 64), (20, 136)]
GROUP_SIZES = [32, 64, 128, -1]


def int_weight(n: int, k: int, seed: int) -> np.ndarray:
    """float16 weights with the cases the quantizer must pin: an all-zero row (scale 0), a group whose largest
    positive and negative magnitudes tie (the positive one wins), both signs of peaks."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float16)
    w[1] = 0
    w[2, :32] = np.clip(w[2, :32], -1, 1)
    w[2, 3], w[2, 7] = 1.5, -1.5
    w[3] *= -3
    return w


def bf16_weight(n: int, k: int, seed: int) -> np.ndarray:
    """float32 weights with mantissa bits below bf16, and exact halfway cases (ties go to even)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x40490FDB, 0x00008000, 0x7F7FFFFF], dtype=np.uint32)
    w[0, : ties.size] = ties.view(np.float32)
    return w


def cases(layout: str, bits: int):
    if not expert_format(layout).quantized:
        for n, k in BF16_SHAPES:
            yield n, k, 128
    else:
        for n, k in INT_SHAPES:
            for g in GROUP_SIZES:
                yield n, k, g


def case_fits(g: int, scale_dtype: str) -> bool:
    """Two-level scales exist for group 32 only; the others take every group size."""
    return scale_encoding(scale_dtype).fixed_group in (None, g)


def write_case(layout: str, version: int, bits: int, n: int, k: int, g: int, seed: int,
               scale_dtype: str = UNDECLARED_SCALE_DTYPE) -> dict:
    geom = MatrixGeometry(n, k, bits, g, scale_dtype)
    if not geom.format.quantized:
        w = bf16_weight(n, k, seed)
        arrays = {"weight": w, "bits": f32_to_bf16_bits(pad_weight(w, geom)), "qweight": pack_bf16(w, geom)}
        name = f"{layout}.v{version}.n{n}_k{k}.npz"
    else:
        w = int_weight(n, k, seed)
        codes, scales = quantize(w.astype(np.float32), geom)
        arrays = {"weight": w, "codes": codes, "scales": scales, "qweight": pack_codes(codes, geom),
                  "packed_scales": pack_scales(scales, geom)}
        if not scale_encoding(scale_dtype).elementwise:       # two-level: the decomposition too
            arrays["super_scales"], arrays["sub_scales"] = two_level_decompose(scales)
        tag = "" if scale_dtype == UNDECLARED_SCALE_DTYPE else f".{scale_dtype}"
        name = f"{layout}.v{version}{tag}.n{n}_k{k}_g{g}.npz"
    path = HERE / name
    if path.exists():
        raise SystemExit(f"{path} exists; golden files are written once (bump the layout version instead)")
    np.savez_compressed(path, **arrays)
    return {"file": name, "layout": layout, "layout_version": version, "bits": bits, "n": n, "k": k,
            "group_size": g, **({} if not geom.format.quantized or scale_dtype == UNDECLARED_SCALE_DTYPE
                                else {"scale_dtype": scale_dtype}),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def written_versions(layout: str) -> list[tuple[int, tuple[str, ...]]]:
    """(version, scale dtypes) this code still writes for `layout`: every int layout version (version 1 for
    float32 scales, version 2 for 16-bit ones, version 3 for two-level ones: int4 only), the current version of
    bf16."""
    fmt = expert_format(layout)
    if not fmt.quantized:
        return [(fmt.layout_version(), (UNDECLARED_SCALE_DTYPE,))]
    out = []
    for v in layout_versions():
        try:
            out.append((v, tuple(r.name for r in layout_records(layout, v)[1])))
        except LayoutError:        # no such version of this layout (version 3 of int8)
            continue
    return out


def main() -> None:
    index = json.loads(INDEX.read_text()) if INDEX.exists() else {"files": []}
    done = {(e["layout"], e["layout_version"]) for e in index["files"]}
    added = []
    for layout, bits in ((f.layout, f.bits) for f in expert_formats()):
        for version, scale_dtypes in written_versions(layout):
            if (layout, version) in done:
                print(f"{layout} v{version}: already in index.json, left as is")
                continue
            for sd in scale_dtypes:
                for i, (n, k, g) in enumerate(cases(layout, bits)):     # i: the seed, the same in every version
                    if case_fits(g, sd):
                        added.append(write_case(layout, version, bits, n, k, g, seed=1000 * bits + i, scale_dtype=sd))
    index["files"] += added
    INDEX.write_text(json.dumps(index, indent=1) + "\n")
    print(f"wrote {len(added)} golden files, {sum((HERE / e['file']).stat().st_size for e in added)} bytes")


if __name__ == "__main__":
    main()
