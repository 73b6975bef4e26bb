"""kt-kernel's routed-expert weight formats (KTransformers' CPU kernels, `--kt-method`, checked against kt-kernel
0.7.2): the AMXINT4 / AMXINT8 tile dumps, and the size rules kt-kernel puts on every method.

All four methods keep symmetric codes; kt-kernel splits each expert over its thread pools ("NUMA" sub-pools, the
`--kt-threadpool-count` N) into N equal parts of the intermediate size I: part m holds gate/up rows and down
columns [m I/N, (m+1) I/N), so a part's matrices are gate/up (I/N, H) and down (H, I/N) in Linear orientation.

GPTQ_INT4  GPTQ `qweight` (K/8, N) int32 + `scales` (K/G, N) (read as float32), zero point fixed at 8, no qzeros,
           desc_act false; one group length G for all projections (kt-kernel derives G = H / len(gate scales)).
RAWINT4    compressed-tensors pack-quantized `weight_packed` (N, K/8) int32 (codes + 8, 8 per word, LSB first) +
           `weight_scale` (N, K/G) **bfloat16**; kt-kernel's default kernel (AMXInt4_KGroup_MOE) runs G = 32.
           Neither has a NUMA dimension on disk: kt-kernel cuts the parts out at load time.
AMXINT8 /  one tensor pair per (layer L, projection, expert E, part M), written by this module:
AMXINT4        blk.L.ffn_{gate,up,down}_exps.E.numa.M.weight   U8: the kernel's B buffer of the part's (n, k) matrix
               blk.L.ffn_{gate,up,down}_exps.E.numa.M.scale    F32 (n,): one scale per output row
           and the number of parts on disk must equal the thread-pool count at load time.

AMX B buffer of an (n, k) matrix (kt-kernel's BufferB of GemmKernel224Int8 / GemmKernel224Int4):
    blocks of N_BLOCK rows (int8 64, int4 128), each split along k into blocks of K_BLOCK = 3584 columns (the last
    one shorter); a block (nbs rows, kbs columns) starts at byte (nb0 * k + kb0 * nbs) * bits / 8 and holds, for
    each 32-row strip n0 and each k step k0 (int8 64 columns, int4 128), 2048 bytes at (n0 * kbs + k0 * 32) * bits / 8:
    int8: two AMX B tiles (rows n0..n0+15, then n0+16..n0+31), each 16 K-quads x 16 rows x 4 bytes:
          tile[r, c, j] = q[n0 + c, k0 + 4r + j]                                 (signed int8, W = q * scale)
    int4: the same two tiles, byte [r, c, j] = q[n0 + c, k0 + 4r + j] in bits 0-3 and q[n0 + c, k0 + 64 + 4r + j]
          in bits 4-7 (4-bit two's complement); the kernel widens a nibble v to the int8 16 v, so
          W = q * 16 * scale.
    Codes are -127..127 (int8) and -7..7 (int4): kt-kernel's AVX-512 path negates weight codes (the sign trick
    for signed x signed dot products), which overflows at -128 (int8) / -8 (int4, widened to -128): a single such
    code corrupts the whole output (measured: 26 % / 100 % error), so pack_amx refuses them. kt-kernel's own
    quantizer (quantize_amx, reproduced bit for bit) never writes them: int8 scale = max|w| * (1/127), codes
    rint(w * (1/scale)); int4 scale = max|w| / 112, codes rint(w * (1/scale)) rounded to a multiple of 16, / 16.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cpu_expert import LayoutError
from .gpu_formats import gpu_format_for

KT_METHODS = ("GPTQ_INT4", "RAWINT4", "AMXINT4", "AMXINT8")
AMX_METHOD_BITS = {"AMXINT8": 8, "AMXINT4": 4}
# GPTQ_INT4 / RAWINT4 read the int4 experts an hf export writes in these GPU formats (ktlayouts.gpu_formats)
KT_METHOD_GPU_FORMAT = {"GPTQ_INT4": gpu_format_for("gptq", 4), "RAWINT4": gpu_format_for("compressed-tensors", 4)}
AMX_N_STEP = 32                         # rows per strip (two 16-row AMX tiles)
AMX_K_STEP = {8: 64, 4: 128}            # columns per strip step (int4: two 64-column tiles share the bytes)
AMX_N_BLOCK = {8: 64, 4: 128}           # rows per block (GemmKernel224Int8 / GemmKernel224Int4 N_BLOCK)
AMX_K_BLOCK = 3584                      # columns per block (K_BLOCK of both kernels)
AMX_SCALE_FACTOR = {8: 1, 4: 16}        # W = q * AMX_SCALE_FACTOR * scale
AMX_QMAX = {8: 127, 4: 7}               # codes -QMAX..QMAX (see the module docstring: no -128 / -8)
RAWINT4_GROUP = 32                      # the group length of kt-kernel's default RAWINT4 kernel
RAW_N_STEP, RAW_K_STEP = 32, 32         # AMXInt4_KGroup_MOE BufferB: n % 32, k % 32, k % G
GPTQ_GROUPS = (32, 64, 128)             # group lengths the GPTQ_INT4 kernels take that GPU GPTQ also has
PROJ_NAMES = {"gate": "gate", "up": "up", "down": "down"}


class KtAlignmentError(LayoutError):
    """A size that kt-kernel cannot load or run: names the rule and why."""


def amx_tensor_name(layer: int, proj: str, expert: int, part: int, kind: str) -> str:
    """'blk.3.ffn_gate_exps.7.numa.1.weight' (kind 'weight' or 'scale')."""
    if proj not in PROJ_NAMES or kind not in ("weight", "scale"):
        raise LayoutError(f"no kt-kernel tensor for projection {proj!r} / {kind!r}")
    return f"blk.{layer}.ffn_{proj}_exps.{expert}.numa.{part}.{kind}"


@dataclass(frozen=True)
class KtAmxGeometry:
    """One part's (n, k) matrix in an AMX method (bits 8 or 4); raises KtAlignmentError when kt-kernel refuses it."""
    n: int
    k: int
    bits: int
    what: str = "matrix"

    def __post_init__(self):
        if self.bits not in AMX_N_BLOCK:
            raise LayoutError(f"kt-kernel AMX methods have 4 or 8 bits, got {self.bits}")
        step = AMX_K_STEP[self.bits]
        if self.n <= 0 or self.n % AMX_N_STEP:
            raise KtAlignmentError(
                f"{self.what}: {self.n} output rows is no multiple of {AMX_N_STEP}: kt-kernel's AMX{'INT8' if self.bits == 8 else 'INT4'} "
                f"buffer stores rows in strips of {AMX_N_STEP} (two 16-row AMX tiles) and refuses other sizes")
        if self.k <= 0 or self.k % step:
            raise KtAlignmentError(
                f"{self.what}: {self.k} input columns is no multiple of {step}: kt-kernel's "
                f"AMX{'INT8' if self.bits == 8 else 'INT4'} buffer packs {step} columns per step "
                f"({'one 64-column AMX tile' if self.bits == 8 else 'two 64-column tiles in the two nibbles of each byte'})")

    @property
    def weight_nbytes(self) -> int:
        return self.n * self.k * self.bits // 8

    @property
    def scale_nbytes(self) -> int:
        return 4 * self.n

    def blocks(self):
        """(row0, rows, col0, cols, byte offset) of every (N_BLOCK x K_BLOCK) block, in file order."""
        nb = AMX_N_BLOCK[self.bits]
        for n0 in range(0, self.n, nb):
            nbs = min(nb, self.n - n0)
            for k0 in range(0, self.k, AMX_K_BLOCK):
                kbs = min(AMX_K_BLOCK, self.k - k0)
                yield n0, nbs, k0, kbs, (n0 * self.k + k0 * nbs) * self.bits // 8


def _check_codes(q: np.ndarray, geom: KtAmxGeometry) -> np.ndarray:
    q = np.asarray(q)
    if q.shape != (geom.n, geom.k):
        raise LayoutError(f"{geom.what}: codes {q.shape} != ({geom.n}, {geom.k})")
    qmax = AMX_QMAX[geom.bits]
    if q.size and (int(q.min()) < -qmax or int(q.max()) > qmax):
        raise LayoutError(f"{geom.what}: codes outside -{qmax}..{qmax}: kt-kernel's AVX-512 kernels negate weight "
                          f"codes and overflow at -{qmax + 1}")
    return q.astype(np.int8, copy=False)


def pack_amx(q: np.ndarray, geom: KtAmxGeometry) -> np.ndarray:
    """Signed codes q (n, k) -> the part's .weight bytes (weight_nbytes,) uint8."""
    q = _check_codes(q, geom).view(np.uint8)
    out = np.empty(geom.weight_nbytes, dtype=np.uint8)
    for n0, nbs, k0, kbs, off in geom.blocks():
        sub = q[n0:n0 + nbs, k0:k0 + kbs]
        if geom.bits == 8:
            # [strip, half, c, kstep, r, j] -> [strip, kstep, half, r, c, j]
            t = sub.reshape(nbs // 32, 2, 16, kbs // 64, 16, 4).transpose(0, 3, 1, 4, 2, 5)
        else:
            nib = (sub & 0x0F).reshape(nbs // 32, 2, 16, kbs // 128, 2, 16, 4)   # [.., kstep, lo/hi, r, j]
            b = nib[:, :, :, :, 0] | (nib[:, :, :, :, 1] << 4)                     # [strip, half, c, kstep, r, j]
            t = b.transpose(0, 3, 1, 4, 2, 5)
        out[off: off + nbs * kbs * geom.bits // 8] = t.reshape(-1)
    return out


def unpack_amx(weight: np.ndarray, geom: KtAmxGeometry) -> np.ndarray:
    """Inverse of pack_amx: .weight bytes -> signed codes (n, k) int8."""
    w = np.asarray(weight, dtype=np.uint8).reshape(-1)
    if w.size != geom.weight_nbytes:
        raise LayoutError(f"{geom.what}: {w.size} weight bytes, expected {geom.weight_nbytes}")
    q = np.empty((geom.n, geom.k), dtype=np.int8)
    for n0, nbs, k0, kbs, off in geom.blocks():
        b = w[off: off + nbs * kbs * geom.bits // 8]
        if geom.bits == 8:
            t = b.reshape(nbs // 32, kbs // 64, 2, 16, 16, 4).transpose(0, 2, 4, 1, 3, 5)
            q[n0:n0 + nbs, k0:k0 + kbs] = t.reshape(nbs, kbs).view(np.int8)
        else:
            t = b.reshape(nbs // 32, kbs // 128, 2, 16, 16, 4).transpose(0, 2, 4, 1, 3, 5)  # [s, half, c, ks, r, j]
            lo = (t & 0x0F).astype(np.int8)
            hi = (t >> 4).astype(np.int8)
            nib = np.stack([lo, hi], axis=4)                                      # [s, half, c, ks, 2, r, j]
            nib = np.where(nib > 7, nib - 16, nib).astype(np.int8)
            q[n0:n0 + nbs, k0:k0 + kbs] = nib.reshape(nbs, kbs)
    return q


def amx_codes_from_rows(codes: np.ndarray, scales: np.ndarray, bits: int, zero: int) -> tuple[np.ndarray, np.ndarray,
                                                                                               int]:
    """Unsigned codes (n, k) with zero point `zero` and one scale per row (n,) -> (signed q, kt scale, clipped):
    q = codes - zero with -2^(bits-1) moved to -QMAX (`clipped` codes: the one value kt-kernel cannot take),
    scale / AMX_SCALE_FACTOR (a power of two: exact). Every other value dequantizes exactly as before."""
    q = codes.astype(np.int16) - zero
    qmax = AMX_QMAX[bits]
    low = q < -qmax
    np.maximum(q, -qmax, out=q)
    return q.astype(np.int8), (np.asarray(scales, dtype=np.float32) / np.float32(AMX_SCALE_FACTOR[bits])), int(low.sum())


def quantize_amx(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """kt-kernel's own per-row quantizer (BufferB::from_mat of GemmKernel224Int8 / Int4), bit for bit on float32
    input: w (n, k) -> (q (n, k) int8, scale (n,) float32). On bf16 weights this gives the bytes kt-kernel's online
    quantization writes (tests/test_kt_kernel_interop.py compares them)."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=1)
    if bits == 8:
        scale = amax * np.float32(1 / 127)
    elif bits == 4:
        scale = (amax / np.float32(112)).astype(np.float32)
    else:
        raise LayoutError(f"kt-kernel AMX methods have 4 or 8 bits, got {bits}")
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    q = np.rint(w * inv[:, None]).clip(-128, 127).astype(np.int16)      # _mm512_cvtps_epi32, saturating to int8
    if bits == 4:                                                         # round |q| to a multiple of 16, keep sign
        q = np.sign(q) * (((np.abs(q) + 8) & 0xF0) >> 4)
    return q.astype(np.int8), scale.astype(np.float32)


def amx_dequantize(q: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """What kt-kernel computes with: W (n, k) float32 = q * AMX_SCALE_FACTOR * scale[row]."""
    return q.astype(np.float32) * (np.asarray(scale, np.float32) * np.float32(AMX_SCALE_FACTOR[bits]))[:, None]


# --- the size rules of every method (checked before anything is written) --------------------------

def check_parts(intermediate: int, n_parts: int) -> int:
    """kt-kernel's TP split: I / N per part. KtAlignmentError when I is no multiple of N."""
    if n_parts < 1:
        raise KtAlignmentError(f"--numa-nodes (kt-kernel's thread-pool count) must be >= 1, got {n_parts}")
    if intermediate % n_parts:
        raise KtAlignmentError(
            f"intermediate size {intermediate} is no multiple of {n_parts} NUMA parts: kt-kernel splits every "
            f"expert into equal parts of the intermediate size, one per thread pool (--kt-threadpool-count)")
    return intermediate // n_parts


def check_amx(hidden: int, intermediate: int, n_parts: int, bits: int) -> dict[str, KtAmxGeometry]:
    """The part geometries {gate, up, down} of an AMX method, or KtAlignmentError naming the rule."""
    part = check_parts(intermediate, n_parts)
    gu = KtAmxGeometry(part, hidden, bits, f"gate/up part (I/N = {intermediate}/{n_parts}, H = {hidden})")
    dn = KtAmxGeometry(hidden, part, bits, f"down part (H = {hidden}, I/N = {intermediate}/{n_parts})")
    return {"gate": gu, "up": gu, "down": dn}


def check_gptq(hidden: int, intermediate: int, n_parts: int, group: int) -> None:
    """GPTQ_INT4: one group length G for gate/up (K = H) and down (K = I/N), G in GPTQ_GROUPS, K % 8 == 0."""
    part = check_parts(intermediate, n_parts)
    if group not in GPTQ_GROUPS:
        raise KtAlignmentError(f"GPTQ_INT4 group length {group} is not one of {GPTQ_GROUPS}")
    for what, k in (("hidden size H", hidden), (f"down part I/N = {intermediate}/{n_parts}", part)):
        if k % group:
            raise KtAlignmentError(
                f"GPTQ_INT4: {what} = {k} is no multiple of the group length {group}: kt-kernel reads one group "
                f"length for all projections (H / number of gate scale rows) and cuts down's groups per part")


def check_rawint4(hidden: int, intermediate: int, n_parts: int, group: int) -> None:
    """RAWINT4: G == 32 (the default kernel), rows % 32 and columns % 32 of every part matrix."""
    part = check_parts(intermediate, n_parts)
    if group != RAWINT4_GROUP:
        raise KtAlignmentError(
            f"RAWINT4 group length {group}: kt-kernel's default RAWINT4 kernel (AMXInt4_KGroup_MOE) runs group "
            f"{RAWINT4_GROUP} only")
    for what, size, step in (("gate/up rows I/N", part, RAW_N_STEP), ("down rows H", hidden, RAW_N_STEP),
                             ("gate/up columns H", hidden, RAW_K_STEP), ("down columns I/N", part, RAW_K_STEP)):
        if size % step:
            raise KtAlignmentError(
                f"RAWINT4: {what} = {size} is no multiple of {step}: kt-kernel's RAWINT4 buffer works in "
                f"{RAW_N_STEP}-row x {RAW_K_STEP}-column steps")
