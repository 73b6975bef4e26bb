"""Experiment (not a layout): what a two-level int4 scale scheme (K-quant-like super-block scale + small integer
sub-block scales) would cost in KL, simulated on an existing conversion, before anyone writes the layout and kernels.

Takes a conversion with int4 group-32 f16-scaled experts and writes a copy in which, per super-block of SB groups of
one output row, d = max|s| / qmax is one float16 value and every group's scale becomes q * d with an integer sub-scale
q in [-qmax, qmax] (qmax = 2^(bits-1) - 1); the codes are re-rounded against the new scales from the conversion's own
dequantized weights (no calibration: an upper bound on what a quantizer that searches the sub-scales would reach).
The copy keeps the group-32 f16 layout (q * d stored back as float16, a 2^-11 relative approximation of the f32
product a real layout would use), so `ktrun perplexity` scores it unchanged. Bits per weight of the scheme:
4 + bits/32 + 16/(32 SB), e.g. 6-bit sub-scales per 256 weights = 4.25, the same as group 64 with f16 scales.

    .venv/bin/python bench/bench_quant_vs_llamacpp.py --tools ours --only experts --configs 'g(32|64)-f16' --workdir W
    .venv/bin/python bench/sim_two_level_int4.py W/ours-experts-int4-g32-f16 W/two-level-6 6 8
    .venv/bin/python -m ktrun perplexity W/two-level-6 --text W/heldout.txt --kl-divergence W/ours-bf16.logprobs
"""
from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
from ktlayouts.cpu_expert import MatrixGeometry, pack_codes, pack_scales, unpack_codes, unpack_scales


def tensors(f: Path) -> tuple[np.memmap, dict]:
    """The file mapped read-write and {name: (offset, shape)} from its safetensors header."""
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    return np.memmap(f, mode="r+", dtype=np.uint8), {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1],
                                                       v["shape"]) for k, v in hdr.items() if k != "__metadata__"}


def two_level(s: np.ndarray, sub_bits: int, sb: int) -> np.ndarray:
    """Group scales (N, G) -> q * d per super-block of sb groups (d float16, q integer in [-qmax, qmax])."""
    qmax = 2 ** (sub_bits - 1) - 1
    out = np.zeros_like(s)
    for j in range(0, s.shape[1], sb):
        blk = s[:, j:j + sb]
        d = (np.abs(blk).max(axis=1, keepdims=True) / qmax).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint(np.divide(blk, d, out=np.zeros_like(blk), where=d > 0)), -qmax, qmax)
        out[:, j:j + sb] = q * d
    return out.astype(np.float16).astype(np.float32)


def main() -> None:
    src, dst, sub_bits, sb = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    ex = json.loads((dst / "manifest.json").read_text())["experts"]
    if not (ex["group_size"] == 32 and ex["bits"] == 4 and ex.get("scale_dtype") == "f16"):
        sys.exit(f"error: {src} needs int4 group-32 f16-scaled experts, has {ex}")
    H, I = ex["hidden"], ex.get("intermediate_pad", ex["intermediate"])   # padded intermediate: the tiles
    dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    change = total = 0.0
    for f in sorted((dst / "experts").glob("*.safetensors")):
        mm, where = tensors(f)
        for p, (n, k) in dims.items():
            g = MatrixGeometry(n=n, k=k, bits=4, group_size=32, scale_dtype="f16")
            a, b, shape = where[f"{p}.qweight"]
            qw = mm[a:b].reshape(shape)
            a, b, shape = where[f"{p}.scales"]
            sc = mm[a:b].view(np.float16).reshape(shape)
            for e in range(qw.shape[0]):
                s = unpack_scales(sc[e], g)                                        # (N_pad, G)
                w = (unpack_codes(qw[e], g).astype(np.float32) - 8) * np.repeat(s, 32, axis=1)
                rep = np.repeat(two_level(s, sub_bits, sb), 32, axis=1)
                codes = np.clip(np.rint(np.divide(w, rep, out=np.zeros_like(w), where=rep != 0)), -8, 7)
                change += float(((codes * rep - w) ** 2).sum())
                total += float((w ** 2).sum())
                qw[e] = pack_codes((codes + 8).astype(np.uint8), g)
                sc[e] = pack_scales(rep[:, ::32], g)
        mm.flush()
    print(f"two_level.sub_bits_{sub_bits}.superblock_{sb}.bpw: {4 + sub_bits / 32 + 16 / (32 * sb):.4f} bits/weight")
    print(f"two_level.sub_bits_{sub_bits}.superblock_{sb}.weight_change: {np.sqrt(change / total):.5f} relative")


if __name__ == "__main__":
    main()
