"""CPU routed-expert layouts: cpu-expert-int8, cpu-expert-int4, cpu-expert-bf16 (spec: README.md).

A weight W of one expert projection is (N, K) in Linear orientation (N outputs, K inputs):
gate/up: N = I (intermediate), K = H (hidden); down: N = H, K = I.

int8 / int4: symmetric per-group quantization along K, unsigned codes with zero point (128 / 8):
    W[n, k] ~= (code[n, k] - ZERO) * scale[n, k // G]
Codes are tiled as AMX B tiles of 16 output columns x 64 K (VNNI: 4 consecutive K per 32-bit word):
    qweight: (N_pad/16, K_pad/64, TILE_BYTES) uint8, TILE_BYTES = 1024 (int8) or 512 (int4)
    scales:  (N_pad/16, n_groups, 16) float32 (layout version 1) or float16 / bfloat16 (version 2), or uint8
             two-level records (version 3, `sub6`, int4 group 32): per 16 columns x 8 groups one 128-byte record of
             16 x 8 signed 6-bit sub-scales q and 16 float16 super-scales d, scale = d * q (README.md)
int4 packs tile rows in pairs: byte j of chunk c (64 bytes) = row 2c at bits 0-3, row 2c+1 at bits 4-7.
bf16: (N_pad/16, K_pad/32, 1024) bytes, each tile 16 rows (K pairs) x 16 columns x 2 bf16 (TDPBF16PS B tile).

Which format a geometry is comes from its records (ktlayouts.expert_formats: MatrixGeometry.format by bits,
.encoding by scale dtype), never from comparing names; each record's reference pack/unpack is a codec class below
(WeightCodec / ScaleCodec), registered under the record's `packing`.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import lcm
from typing import ClassVar

import numpy as np

from .bf16 import bf16_bits_to_f32, f32_to_bf16_bits, round_to_bf16
from .constants import ACT_QMAX
from .expert_formats import (
    GROUP_PER_ROW,
    SUB6_RANGE,
    SUB6_RECORD_BYTES,
    SUB6_SUPER_GROUPS,
    SUB6_SUPER_SIG_BITS,
    TILE_K,
    TILE_N,
    TILE_ROW_BYTES,
    TILE_ROWS,
    UNDECLARED_SCALE_DTYPE,
    VNNI_BF16,
    VNNI_INT8,
    ExpertFormat,
    LayoutError,
    ScaleEncoding,
    expert_format_of_bits,
    scale_encoding,
    scale_encodings,
)


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def group_unit(group_size: int, scale_dtype: str = UNDECLARED_SCALE_DTYPE) -> int:
    """K granularity of the int layouts that keeps tile, group and scale-record boundaries: lcm(64, G), 64 for
    per-row, lcm(64, 8 G) = 256 for two-level scales (their records span 8 groups)."""
    if group_size == GROUP_PER_ROW:
        return TILE_K
    return lcm(TILE_K, scale_encoding(scale_dtype).super_groups * group_size)


def k_unit(bits: int, group_size: int, scale_dtype: str = UNDECLARED_SCALE_DTYPE) -> int:
    """K granularity of the bits-bit layout: group_unit for the int layouts, a tile (64) for unquantized ones."""
    return group_unit(group_size, scale_dtype) if expert_format_of_bits(bits).quantized else TILE_K


def check_scale_dtype(scale_dtype: str, bits: int, group_size: int) -> None:
    """Scales the bits-bit layout with this group cannot store (two-level scales: int4 group 32 only): an error naming
    the flags."""
    scale_encoding(scale_dtype).check(bits, group_size)


def check_group_size(group_size: int, bits: int = 8) -> None:
    """The group rule of the bits-bit int layout: 32, a multiple of 64, or -1 (per row)."""
    expert_format_of_bits(bits).check_group_size(group_size)


@dataclass(frozen=True)
class MatrixGeometry:
    """Padded sizes and byte counts of one packed (N, K) expert matrix."""
    n: int
    k: int
    bits: int          # 4, 8 or 16 (bf16): the ExpertFormat record of these bits (ktlayouts.expert_formats)
    group_size: int    # as requested: 32, 64m, or -1 for per row
    scale_dtype: str = UNDECLARED_SCALE_DTYPE   # a ScaleEncoding's name: f32 (layout version 1), f16 or bf16
                                                # (version 2), sub6 (version 3, two-level)

    def __post_init__(self):
        if self.n <= 0 or self.k <= 0:
            raise LayoutError(f"cannot tile an empty matrix of shape ({self.n}, {self.k})")
        scale_encoding(self.scale_dtype)
        self.format.check(self.group_size, self.scale_dtype)

    @property
    def format(self) -> ExpertFormat:
        """The weights' record: bits, zero point, tiles, packing."""
        return expert_format_of_bits(self.bits)

    @property
    def encoding(self) -> ScaleEncoding:
        """The scales' record (unquantized formats: the undeclared one; they store no scales)."""
        return scale_encoding(self.scale_dtype)

    @property
    def n_pad(self) -> int:
        return round_up(self.n, TILE_N)

    @property
    def k_pad(self) -> int:
        return round_up(self.k, k_unit(self.bits, self.group_size, self.scale_dtype))

    @property
    def group(self) -> int:
        """Effective group length along K (k_pad for per-row and unquantized formats)."""
        return self.k_pad if self.group_size == GROUP_PER_ROW or not self.format.quantized else self.group_size

    @property
    def n_groups(self) -> int:
        return self.k_pad // self.group

    @property
    def n_blocks(self) -> int:
        return self.n_pad // TILE_N

    @property
    def k_per_tile(self) -> int:
        """Input channels per tile: 64 for int tiles, 32 for bf16 tiles."""
        return self.format.k_per_tile

    @property
    def k_tiles(self) -> int:
        """Tiles along K: K/64 for int tiles, K/32 for bf16 tiles."""
        return self.k_pad // self.k_per_tile

    @property
    def tile_bytes(self) -> int:
        """1024 (int8, bf16), 512 (int4): 16 columns x k_per_tile x bits."""
        return self.format.tile_bytes

    @property
    def qweight_shape(self) -> tuple[int, int, int]:
        return (self.n_blocks, self.k_tiles, self.tile_bytes)

    @property
    def scales_shape(self) -> tuple[int, int, int]:
        return (self.n_blocks, self.n_groups, TILE_N)

    @property
    def qweight_nbytes(self) -> int:
        return self.n_blocks * self.k_tiles * self.tile_bytes

    @property
    def scales_nbytes(self) -> int:
        if not self.format.quantized:
            return 0
        return self.n_blocks * self.n_groups * TILE_N * self.encoding.nbytes


# --- quantization -------------------------------------------------------------------------------

QUANTIZE_CHUNK = 1 << 18     # weights per step of quantize (1 MB of float32)


def pad_weight(w: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """w: (N, K) float -> (N_pad, K_pad) float32, zero padded (no copy when w already is that)."""
    if w.shape != (geom.n, geom.k):
        raise LayoutError(f"weight shape {tuple(w.shape)} does not match geometry ({geom.n}, {geom.k})")
    if w.shape == (geom.n_pad, geom.k_pad) and w.dtype == np.float32:
        return w
    out = np.zeros((geom.n_pad, geom.k_pad), dtype=np.float32)
    out[: geom.n, : geom.k] = w
    return out


def quantize(w: np.ndarray, geom: MatrixGeometry, bf16_scales: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-group quantization. w: (N, K) -> codes (N_pad, K_pad) uint8, scales (N_pad, n_groups) f32.
    Two-level scales (sub6): the group scales of this rule become d * q by `two_level_rule`.

    The scale maps the group's largest-magnitude value (the positive one on a tie) onto the most negative code
    (-2^(b-1)), so all 2^b levels are used (as llama.cpp's Q4_0/Q8_0 do); a scale may therefore be negative.
    It is rounded to the stored dtype (16-bit scales, layout version 2) and the codes are computed against the
    rounded value (clipped to the code range). An all-zero group gets scale 0. bf16_scales: the scale is rounded to
    bfloat16 first (then to the stored dtype, which keeps a bf16 value exact for f32, bf16, and f16 within f16's
    normal range), so the stored scales are exact in bf16 (formats with bf16 scales, e.g. kt-kernel's RAWINT4, then
    take them over without rounding).
    """
    if not geom.format.quantized:
        raise LayoutError(f"{geom.format.layout} is not quantized; use pack_expert_matrix")
    wp = pad_weight(w, geom).reshape(geom.n_pad, geom.n_groups, geom.group)
    qmin = -(1 << (geom.bits - 1))
    codec = scale_codec(geom.scale_dtype)
    codes = np.empty((geom.n_pad, geom.k_pad), np.uint8)
    scale = np.empty((geom.n_pad, geom.n_groups), np.float32)
    # rows a chunk at a time (every step is per row): the float temporaries stay small and are reused instead of
    # being fresh matrix-sized arrays (fresh pages the kernel zeroes); the same values as whole-matrix steps
    rows = max(1, QUANTIZE_CHUNK // geom.k_pad)
    for r in range(0, geom.n_pad, rows):
        blk = wp[r:r + rows]                                                # (rows, n_groups, group)
        hi, lo = blk.max(axis=2), blk.min(axis=2)
        peak = np.where(hi >= -lo, hi, lo)                                  # (rows, n_groups) signed
        s = scale[r:r + rows] = codec.rule((peak / np.float32(qmin)).astype(np.float32), bf16_scales)
        inv = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s != 0)
        q = blk * inv[..., None]                                            # one pass each, in place
        np.rint(q, out=q)
        np.clip(q, qmin, -qmin - 1, out=q)
        q -= qmin
        codes[r:r + rows] = q.reshape(len(q), geom.k_pad)                  # exact small integers -> uint8
    return codes, scale


def dequantize(codes: np.ndarray, scales: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """codes (N_pad, K_pad) uint8, scales (N_pad, n_groups) -> (N_pad, K_pad) float32."""
    z = geom.format.zero_point
    q = codes.astype(np.float32).reshape(geom.n_pad, geom.n_groups, geom.group) - z
    return (q * scales[..., None].astype(np.float32)).reshape(geom.n_pad, geom.k_pad)


# --- tile packing -------------------------------------------------------------------------------

def _to_tiles(a: np.ndarray, geom: MatrixGeometry, per_word: int) -> np.ndarray:
    """a: (N_pad, K_pad) -> (NB, KT, 16 rows, 16 cols, per_word): element [nb, kt, r, n, j] = a[nb*16+n, kt*16*pw + r*pw + j]."""
    nb, kt = geom.n_blocks, geom.k_pad // (TILE_ROWS * per_word)
    t = a.reshape(nb, TILE_N, kt, TILE_ROWS, per_word)
    return t.transpose(0, 2, 3, 1, 4)


def _from_tiles(t: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    return np.ascontiguousarray(t.transpose(0, 3, 1, 2, 4)).reshape(geom.n_pad, geom.k_pad)


def pack_codes(codes: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """codes (N_pad, K_pad) uint8 -> qweight (NB, K_pad/64, tile_bytes) uint8 (the format's WeightCodec)."""
    return weight_codec(geom.format).pack_codes(codes, geom)


def unpack_codes(qweight: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """Inverse of pack_codes: qweight (NB, KT, tile_bytes) -> codes (N_pad, K_pad) uint8."""
    return weight_codec(geom.format).unpack_codes(qweight, geom)


def round_scales(s: np.ndarray, scale_dtype: str) -> np.ndarray:
    """float32 values rounded to the stored scale dtype (round to nearest even), as float32."""
    return scale_codec(scale_dtype).round(np.asarray(s, dtype=np.float32))


def scales_representable(s: np.ndarray, scale_dtype: str) -> bool:
    """Whether float32 scales are stored exactly in scale_dtype (exact take-over of already-quantized sources)."""
    return scale_codec(scale_dtype).representable(np.asarray(s, dtype=np.float32))


def scales_to_f32(packed: np.ndarray, scale_dtype: str) -> np.ndarray:
    """Stored scales (float32, float16, bfloat16 bit patterns as uint16, or two-level records of shape
    (..., n_groups, 16) uint8) -> float32 of the same shape, exactly."""
    return scale_codec(scale_dtype).to_f32(np.asarray(packed))


def pack_scales(scales: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """scales (N_pad, n_groups) -> (NB, n_groups, 16) in the stored dtype (float32 / float16 / bfloat16 bits as
    uint16): the 16 scales of a column block for one group are one vector. Values must already be representable."""
    return scale_codec(geom.scale_dtype).pack(np.asarray(scales, dtype=np.float32), geom)


def unpack_scales(packed: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """Inverse of pack_scales -> (N_pad, n_groups) float32."""
    s = scales_to_f32(np.asarray(packed).reshape(geom.scales_shape), geom.scale_dtype)      # (NB, n_groups, 16)
    return np.ascontiguousarray(s.transpose(0, 2, 1)).reshape(geom.n_pad, geom.n_groups)


# --- two-level scales (layout version 3, sub6) --------------------------------------------------------------------

def round_super_scale(d: np.ndarray, sig_bits: int = SUB6_SUPER_SIG_BITS) -> np.ndarray:
    """The nearest float16 values with at most sig_bits significant bits (significand rounded half to even), as
    float32. The layout stores any float16 d; the rule and the quantizers keep 6 bits so that every d * q is a float16
    value too (|q| <= 32: at most 11 significant bits), which GPU formats with float16 scales hold exactly."""
    d = np.clip(np.asarray(d, dtype=np.float32), -65504, 65504)
    m, e = np.frexp(d)                                            # d = m 2^e, 0.5 <= |m| < 1
    r = np.ldexp(np.rint(m * np.float32(1 << sig_bits)) / np.float32(1 << sig_bits), e)
    return np.clip(r, -65504, 65504).astype(np.float16).astype(np.float32)


def two_level_rule(scales: np.ndarray) -> np.ndarray:
    """The reference rule's group scales (N, n_groups), n_groups a multiple of 8 -> two-level values d * q: per row
    and super-block d = round_super_scale(max |s| / 31), q = clip(rint(s / d), -32, 31) (0 where d = 0)."""
    s = np.asarray(scales, dtype=np.float32).reshape(scales.shape[0], -1, SUB6_SUPER_GROUPS)
    d = round_super_scale(np.abs(s).max(axis=2) / np.float32(SUB6_RANGE[1]))
    q = np.clip(np.rint(np.divide(s, d[..., None], out=np.zeros_like(s), where=d[..., None] != 0)), *SUB6_RANGE)
    return (d[..., None] * q).reshape(scales.shape).astype(np.float32)


def two_level_decompose(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Group scales (N, n_groups) -> (d (N, n_groups / 8) float32 holding float16 values, q (N, n_groups) int8) with
    d * q == scales exactly, or None when some super-block has no such pair. Canonical: per super-block, the first
    sub-scale t of its largest-magnitude group s (the first such group) for which d = float16(s / t) represents all
    8 groups, trying |t| = 32, 31, ..., 1 and, per magnitude, d > 0 before d < 0 (all-zero super-blocks: d = 0,
    q = 0), so the stored bytes are a function of the scale values alone."""
    s = np.asarray(scales, dtype=np.float32)
    if s.ndim != 2 or s.shape[1] % SUB6_SUPER_GROUPS:
        raise LayoutError(f"two-level scales need (N, 8 m) group scales, got shape {s.shape}")
    s = s.reshape(s.shape[0], -1, SUB6_SUPER_GROUPS)                      # (N, n_super, 8)
    top = np.take_along_axis(s, np.abs(s).argmax(axis=2)[..., None], axis=2)[..., 0]
    d = np.zeros(top.shape, np.float32)
    q = np.zeros(s.shape, np.float32)
    done = top == 0
    lo, hi = SUB6_RANGE
    sign = np.where(top < 0, -1.0, 1.0)
    for t in [k * p for k in range(-lo, 0, -1) for p in (1.0, -1.0)]:         # t * sign: d > 0 first
        if done.all():
            break
        tt = t * sign
        with np.errstate(over="ignore", invalid="ignore"):
            dt = np.where((tt >= lo) & (tt <= hi), top.astype(np.float64) / tt, 0).astype(np.float16).astype(np.float32)
        qt = np.rint(np.divide(s, dt[..., None], out=np.zeros_like(s), where=dt[..., None] != 0))
        ok = ~done & (dt != 0) & np.all((qt >= lo) & (qt <= hi) & (dt[..., None] * qt == s), axis=2)
        d, q, done = np.where(ok, dt, d), np.where(ok[..., None], qt, q), done | ok
    if not done.all():
        return None
    return d, q.reshape(scales.shape).astype(np.int8)


def pack_two_level(d: np.ndarray, q: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """d (N_pad, n_super) float16 values, q (N_pad, n_groups) in [-32, 31] -> scales (NB, n_groups, 16) uint8: per
    column block and super-block one 128-byte record (two cache lines): bytes 0-63 `ql` (byte 16 j + c: low 4 bits
    of u(j, c) in bits 0-3, of u(j + 4, c) in bits 4-7), bytes 64-95 the 16 columns' d (float16), bytes 96-127 `qh`
    (byte 16 h + c: bits 2 i, 2 i + 1 = bits 4-5 of u(4 h + i, c)), u = q & 63 (6-bit two's complement), j the
    group within the super-block (0..7), c the column within the block."""
    nb, ns = geom.n_blocks, geom.n_groups // SUB6_SUPER_GROUPS
    dd = np.ascontiguousarray(np.asarray(d, np.float32).reshape(nb, TILE_N, ns).transpose(0, 2, 1), np.float16)
    u = (np.asarray(q).astype(np.int16) & 63).astype(np.uint8)
    u = u.reshape(nb, TILE_N, ns, SUB6_SUPER_GROUPS).transpose(0, 2, 3, 1)                        # (NB, ns, 8, 16)
    ql = (u[:, :, :4] & 15) | ((u[:, :, 4:] & 15) << 4)                                           # (NB, ns, 4, 16)
    hi = (u >> 4).reshape(nb, ns, 2, 4, TILE_N)
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)    # (NB, ns, 2, 16)
    rec = np.concatenate([ql.reshape(nb, ns, 64), dd.view(np.uint8).reshape(nb, ns, 32), qh.reshape(nb, ns, 32)],
                         axis=2)
    return np.ascontiguousarray(rec).reshape(geom.scales_shape)


def unpack_two_level(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two-level records (..., n_groups, 16) uint8 -> (d (..., n_super, 16) float32, q (..., n_groups, 16) int8),
    in the stored (block, group, column) order."""
    a = np.ascontiguousarray(packed, dtype=np.uint8)
    lead, ng = a.shape[:-2], a.shape[-2]
    if a.shape[-1] != TILE_N or ng % SUB6_SUPER_GROUPS:
        raise LayoutError(f"two-level scale records need shape (..., 8 m, 16) uint8, got {a.shape}")
    rec = a.reshape(*lead, ng // SUB6_SUPER_GROUPS, SUB6_RECORD_BYTES)
    ql = rec[..., :64].reshape(*rec.shape[:-1], 4, TILE_N)
    d = rec[..., 64:96].copy().view(np.float16).astype(np.float32)                 # (..., ns, 16)
    qh = rec[..., 96:].reshape(*rec.shape[:-1], 2, TILE_N)
    lo = np.concatenate([ql & 15, ql >> 4], axis=-2)                               # (..., ns, 8, 16)
    hi = np.stack([(qh >> (2 * i)) & 3 for i in range(4)], axis=-2).reshape(lo.shape)
    u = (lo | (hi << 4)).astype(np.int16)
    q = np.where(u >= 32, u - 64, u).astype(np.int8)
    return d, q.reshape(*lead, ng, TILE_N)


def pack_bf16(w: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """w (N, K) float -> (NB, K_pad/32, 1024) uint8: bf16 tiles, 2 consecutive K per 32-bit word."""
    bits = f32_to_bf16_bits(pad_weight(w, geom))
    t = np.ascontiguousarray(_to_tiles(bits, geom, VNNI_BF16))
    return t.view(np.uint8).reshape(geom.qweight_shape)


def unpack_bf16(qweight: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """Inverse of pack_bf16 -> (N_pad, K_pad) float32."""
    t = np.ascontiguousarray(qweight, dtype=np.uint8).view(np.uint16)
    t = t.reshape(geom.n_blocks, geom.k_tiles, TILE_ROWS, TILE_N, VNNI_BF16)
    return bf16_bits_to_f32(_from_tiles(t, geom))


def pack_expert_matrix(w: np.ndarray, geom: MatrixGeometry,
                       bf16_scales: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """w (N, K) float -> (qweight, packed scales or None for bf16). The converter's single entry point.
    bf16_scales: scales rounded to bfloat16 before the codes are computed (see quantize)."""
    return weight_codec(geom.format).pack_matrix(w, geom, bf16_scales)


def pack_expert_codes(codes: np.ndarray, scales: np.ndarray, geom: MatrixGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Already-quantized weights (codes (N, K) uint8 with this layout's zero point, scales (N, K / G) float32) ->
    packed (qweight, scales), padding with code ZERO and scale 0. For sources whose blocks map exactly onto the
    layout (GGUF Q8_0 -> int8 group 32): no float round trip. Scales the stored dtype cannot hold exactly raise."""
    if not geom.format.quantized or geom.group_size == GROUP_PER_ROW or codes.shape != (geom.n, geom.k) \
            or geom.k % geom.group or scales.shape != (geom.n, geom.k // geom.group):
        raise LayoutError(f"codes {codes.shape} / scales {scales.shape} do not fit {geom}")
    if not scales_representable(scales, geom.scale_dtype):
        raise LayoutError(f"scales are not exactly representable as {geom.scale_dtype}: no exact take-over")
    c = np.full((geom.n_pad, geom.k_pad), geom.format.zero_point, dtype=np.uint8)
    c[: geom.n, : geom.k] = codes
    sc = np.zeros((geom.n_pad, geom.n_groups), dtype=np.float32)
    sc[: geom.n, : scales.shape[1]] = scales
    return pack_codes(c, geom), pack_scales(sc, geom)


def unpack_expert_matrix(qweight: np.ndarray, scales: np.ndarray | None, geom: MatrixGeometry) -> np.ndarray:
    """Packed tensors -> dequantized (N, K) float32 (padding removed)."""
    return weight_codec(geom.format).unpack_matrix(qweight, scales, geom)[: geom.n, : geom.k]


# --- the reference pack/unpack of each record, registered by the record's `packing` --------------------------------
# As gguf-py registers one class per quant type, each packing a record names (ExpertFormat.packing,
# ScaleEncoding.packing) is one class here, found by that name; the module functions above dispatch to them.

class WeightCodec:
    """Reference pack/unpack of an ExpertFormat's weights. A subclass registers under `packing=`."""
    packings: ClassVar[dict[str, type[WeightCodec]]] = {}

    def __init_subclass__(cls, packing: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if packing is not None:
            WeightCodec.packings[packing] = cls

    def __init__(self, fmt: ExpertFormat):
        self.fmt = fmt

    def pack_matrix(self, w: np.ndarray, geom: MatrixGeometry, bf16_scales: bool) -> tuple[np.ndarray, np.ndarray | None]:
        raise NotImplementedError

    def unpack_matrix(self, qweight: np.ndarray, scales: np.ndarray | None, geom: MatrixGeometry) -> np.ndarray:
        """-> (N_pad, K_pad) float32."""
        raise NotImplementedError

    def pack_codes(self, codes: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
        raise LayoutError(f"{self.fmt.layout} holds no integer codes")

    unpack_codes = pack_codes


class IntTiles(WeightCodec, packing="int-tiles"):
    """Unsigned codes in AMX B tiles (VNNI: 4 consecutive K per 32-bit word); below 8 bits, 8 / bits consecutive tile
    rows share the bytes of one 64-byte chunk, row p of the chunk at bits p x bits (int4: even rows in the low
    nibbles, odd rows in the high ones)."""

    def pack_codes(self, codes: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
        t = np.ascontiguousarray(_to_tiles(codes, geom, VNNI_INT8))              # (NB, KT, 16, 16, 4)
        per_byte = 8 // geom.bits
        if per_byte == 1:
            return t.reshape(geom.qweight_shape)
        if codes.max(initial=0) >= 1 << geom.bits:
            raise LayoutError(f"int{geom.bits} codes must be in 0..{(1 << geom.bits) - 1}")
        rows = t.reshape(geom.n_blocks, geom.k_tiles, TILE_ROWS // per_byte, per_byte, TILE_ROW_BYTES)
        packed = rows[:, :, :, 0, :]
        for p in range(1, per_byte):
            packed = packed | (rows[:, :, :, p, :] << (p * geom.bits))
        return np.ascontiguousarray(packed).reshape(geom.qweight_shape)

    def unpack_codes(self, qweight: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
        q = np.asarray(qweight, dtype=np.uint8).reshape(geom.qweight_shape)
        t = self.tile_rows(q.reshape(geom.n_blocks, geom.k_tiles, -1))
        return _from_tiles(t.reshape(geom.n_blocks, geom.k_tiles, TILE_ROWS, TILE_N, VNNI_INT8), geom)

    def tile_rows(self, raw: np.ndarray) -> np.ndarray:
        """Packed tiles (..., tile_bytes) -> (..., 16, 64) code bytes, as a tile load sees them."""
        per_byte = 8 // self.fmt.bits
        chunks = raw.reshape(*raw.shape[:-1], TILE_ROWS // per_byte, TILE_ROW_BYTES)
        if per_byte > 1:
            mask = (1 << self.fmt.bits) - 1
            chunks = np.stack([(chunks >> (p * self.fmt.bits)) & mask for p in range(per_byte)], axis=-2)
        return chunks.reshape(*raw.shape[:-1], TILE_ROWS, TILE_ROW_BYTES)

    def pack_matrix(self, w, geom, bf16_scales):
        codes, scales = quantize(w, geom, bf16_scales)
        return self.pack_codes(codes, geom), pack_scales(scales, geom)

    def unpack_matrix(self, qweight, scales, geom):
        return dequantize(self.unpack_codes(qweight, geom), unpack_scales(scales, geom), geom)


class Bf16Tiles(WeightCodec, packing="bf16-tiles"):
    """bfloat16 weights in TDPBF16PS B tiles (2 consecutive K per 32-bit word); no scales."""

    def pack_matrix(self, w, geom, bf16_scales):
        return pack_bf16(w, geom), None

    def unpack_matrix(self, qweight, scales, geom):
        return unpack_bf16(qweight, geom)


class ScaleCodec:
    """Reference rounding, pack and unpack of a ScaleEncoding. A subclass registers under `packing=`."""
    packings: ClassVar[dict[str, type[ScaleCodec]]] = {}

    def __init_subclass__(cls, packing: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if packing is not None:
            ScaleCodec.packings[packing] = cls

    def __init__(self, enc: ScaleEncoding):
        self.enc = enc

    def round(self, s: np.ndarray) -> np.ndarray:
        """float32 scales -> the nearest stored values, as float32."""
        raise NotImplementedError

    def rule(self, s: np.ndarray, bf16_scales: bool) -> np.ndarray:
        """The reference rule's group scales (N_pad, n_groups) float32 -> the stored values (quantize); bf16_scales:
        bfloat16 values first."""
        return self.round(round_to_bf16(s) if bf16_scales else s)

    def representable(self, s: np.ndarray) -> bool:
        """Whether float32 scales (rows, groups) are stored exactly."""
        raise NotImplementedError

    def pack(self, s: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
        """(N_pad, n_groups) float32 values already representable -> (NB, n_groups, 16) stored."""
        raise NotImplementedError

    def to_f32(self, a: np.ndarray) -> np.ndarray:
        """Stored (..., n_groups, 16) -> float32 of the same shape, exactly."""
        raise NotImplementedError


class FloatScales(ScaleCodec, packing="float"):
    """One floating-point value per (column, group) in a numpy dtype (float32, float16), round to nearest even."""

    def _store(self, s: np.ndarray) -> np.ndarray:
        return s.astype(self.enc.array_dtype, copy=False)

    def _load(self, a: np.ndarray) -> np.ndarray:
        return a.astype(np.float32)

    def _fits(self, s: np.ndarray) -> bool:
        return self.enc.finite_max is None or not np.any(np.abs(s) > self.enc.finite_max)

    def round(self, s):
        if not self._fits(s):
            wider = [r.name for r in scale_encodings() if r.elementwise and r.finite_max is None
                     and r.nbytes == self.enc.nbytes]
            raise LayoutError(f"a scale of {float(np.abs(s).max()):g} does not fit {self.enc.what}"
                              + (f" (use --scale-dtype {' or '.join(wider)})" if wider else ""))
        return self._load(self._store(s))

    def representable(self, s):
        return self._fits(s) and bool(np.array_equal(self.round(s), s))

    def pack(self, s, geom):
        s = s.reshape(geom.n_blocks, TILE_N, geom.n_groups)
        return self._store(np.ascontiguousarray(s.transpose(0, 2, 1)))

    def to_f32(self, a):
        return self._load(a)


class Bf16BitScales(FloatScales, packing="bf16-bits"):
    """bfloat16 values, stored as their uint16 bit patterns (numpy has no bfloat16)."""

    def _store(self, s):
        return f32_to_bf16_bits(s).reshape(s.shape)

    def _load(self, a):
        return bf16_bits_to_f32(a.view(np.uint16) if a.dtype != np.uint16 else a)


class TwoLevelScales(ScaleCodec, packing="two-level"):
    """Records of 16 columns x SUB6_SUPER_GROUPS groups: float16 super-scales d, 6-bit sub-scales q (scale = d q)."""

    def round(self, s):
        raise LayoutError(f"{self.enc.what} ({self.enc.name}) are not rounded value by value: use two_level_rule or "
                          "a search")

    def rule(self, s, bf16_scales):
        if bf16_scales:
            raise LayoutError(f"{self.enc.what} ({self.enc.name}) cannot be bfloat16 values (--bf16-scales)")
        return two_level_rule(s)

    def representable(self, s):         # (rows, groups): zero groups up to whole super-blocks change nothing
        s = s.reshape(-1, s.shape[-1]) if s.ndim else s.reshape(1, 1)
        s = np.pad(s, ((0, 0), (0, -s.shape[1] % SUB6_SUPER_GROUPS)))
        return two_level_decompose(s) is not None

    def pack(self, s, geom):
        dq = two_level_decompose(s.reshape(geom.n_pad, geom.n_groups))
        if dq is None:
            raise LayoutError("scales are not two-level values d * q (float16 d per 8 groups, q in [-32, 31])")
        return pack_two_level(*dq, geom)

    def to_f32(self, a):
        d, q = unpack_two_level(a)
        q = q.reshape(*d.shape[:-1], SUB6_SUPER_GROUPS, TILE_N).astype(np.float32)
        return (d[..., None, :] * q).reshape(a.shape)


def weight_codec(fmt: ExpertFormat) -> WeightCodec:
    """The reference pack/unpack of a format's weights (the codec registered under its packing)."""
    try:
        return WeightCodec.packings[fmt.packing](fmt)
    except KeyError:
        raise LayoutError(f"{fmt.layout}: no reference pack/unpack is registered as {fmt.packing!r}") from None


def scale_codec(scale_dtype: str) -> ScaleCodec:
    """The reference rounding, pack and unpack of a scale dtype (the codec registered under its packing)."""
    enc = scale_encoding(scale_dtype)
    try:
        return ScaleCodec.packings[enc.packing](enc)
    except KeyError:
        raise LayoutError(f"scale dtype {enc.name}: no reference pack/unpack is registered as {enc.packing!r}") \
            from None


# --- activations and the AMX-semantics reference -----------------------------------------------

def quantize_activations(x: np.ndarray, geom: MatrixGeometry) -> tuple[np.ndarray, np.ndarray]:
    """x: (T, K) float -> (a_q (T, K_pad) int8, a_s (T, n_groups) f32); one scale per token per weight group."""
    xp = np.zeros((x.shape[0], geom.k_pad), dtype=np.float32)
    xp[:, : geom.k] = x
    g = xp.reshape(x.shape[0], geom.n_groups, geom.group)
    s = (np.abs(g).max(axis=2) / ACT_QMAX).astype(np.float32)
    inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
    q = np.clip(np.rint(g * inv[..., None]), -ACT_QMAX, ACT_QMAX).astype(np.int8)
    return q.reshape(x.shape[0], geom.k_pad), s


def _tdpbsud(a_tile: np.ndarray, b_tile: np.ndarray) -> np.ndarray:
    """AMX TDPBSUD semantics. a_tile: (M, 4*R) int8 (signed); b_tile: (R, 64) uint8 bytes (unsigned).

    C[m][n] = sum_{r<R} sum_{j<4} A[m][4r+j] * B[r][4n+j]   (int32 accumulate)
    """
    m, r = a_tile.shape[0], b_tile.shape[0]
    a = a_tile.astype(np.int64).reshape(m, r, 4)
    b = b_tile.astype(np.int64).reshape(r, TILE_N, 4)
    return np.einsum("mrj,rnj->mn", a, b)


def _b_tile_rows(qweight: np.ndarray, geom: MatrixGeometry, nb: int, kt: int) -> np.ndarray:
    """The 16 x 64 byte B tile as a tile load would see it (int4 expanded nibble-pair-wise to bytes)."""
    return weight_codec(geom.format).tile_rows(qweight[nb, kt])


def amx_reference_matmul(x: np.ndarray, qweight: np.ndarray, scales: np.ndarray, geom: MatrixGeometry) -> np.ndarray:
    """y = x @ W^T computed the way the AMX kernel does, straight from the packed bytes.

    x: (T, K) float; qweight/scales as written to disk. Returns (T, N) float32.
    Per group g and column block: C = TDPBSUD(A_g, B_g) on the raw tile rows, then
    y += a_s[:, g] * s_w[g, n] * (C - ZERO * sum_k A_g[:, k]).
    """
    a_q, a_s = quantize_activations(x, geom)
    z = geom.format.zero_point
    qw = np.asarray(qweight).reshape(geom.qweight_shape)
    sw = scales_to_f32(np.asarray(scales).reshape(geom.scales_shape), geom.scale_dtype)
    rows_per_group = geom.group // VNNI_INT8                  # 8 for G=32, 16 per 64 otherwise
    y = np.zeros((x.shape[0], geom.n_pad), dtype=np.float64)
    for nb in range(geom.n_blocks):
        acc = np.zeros((x.shape[0], TILE_N), dtype=np.float64)
        for g in range(geom.n_groups):
            k0, k1 = g * geom.group, (g + 1) * geom.group
            c = np.zeros((x.shape[0], TILE_N), dtype=np.int64)
            for kk in range(k0, k1, min(TILE_K, geom.group)):   # one (half) tile per step
                kt, r0 = kk // TILE_K, (kk % TILE_K) // VNNI_INT8
                b = _b_tile_rows(qw, geom, nb, kt)[r0: r0 + min(TILE_ROWS, rows_per_group)]
                c += _tdpbsud(a_q[:, kk: kk + 4 * b.shape[0]], b)
            comp = z * a_q[:, k0:k1].astype(np.int64).sum(axis=1, keepdims=True)
            acc += a_s[:, g: g + 1].astype(np.float64) * sw[nb, g][None, :] * (c - comp)
        y[:, nb * TILE_N: (nb + 1) * TILE_N] = acc
    return y[:, : geom.n].astype(np.float32)
