"""GPU layout `marlin`: GPTQ-style symmetric codes permuted into the tiles the Marlin W4A16/W8A16 GEMM consumes.

Quantization is exactly that of `gptq.py` (codes (K, N) with zero point 2^(bits-1), fp16 scales (n_groups, N)).
Only the order of bytes differs, so that each GPU warp loads its tensor-core fragments with one 16-byte read:

qweight: (K/16, N*16*bits/32) int32.
  1. Cut codes (K, N) into 16x16 tiles; row t of the tiled matrix is the K-tile t, holding N/16 tiles of 256
     codes each, each tile in row-major order (16 K rows x 16 N columns).
  2. Each run of 1024 values (4 consecutive tiles = 16 K x 64 N) is reordered by the permutation
     `weight_perm(bits)`: for thread i of a warp (32 threads), column c = i // 4 of an 8-column half, rows
     2(i%4), 2(i%4)+1, 2(i%4)+8, 2(i%4)+9, for the two 8-column halves, for the 4 tiles; then within each
     word-sized group the values are interleaved (4-bit: 0,2,4,6,1,3,5,7; 8-bit: 0,2,1,3) so that the
     kernel's lop3 dequantization yields fp16 pairs in register order.
  3. Consecutive values are packed 32/bits per int32, least significant bits first.
scales: (n_groups, N) float16, each run of 64 columns (grouped) or 32 columns (one group, G = -1 or G = K)
  reordered by `scale_perm` / `scale_perm_single` to match the fragment layout of the outputs.

Tiling constraints: N % 64 == 0 and K % 128 == 0 (Marlin's smallest thread tile is 64 N wide, and 128 K deep
for the configurations the kernel picks for small batches); a group size must divide K. `check_marlin_shape` raises LayoutError naming the tensor when a shape does not tile;
the converter pads with zeros instead (layouts/README.md, "Marlin padding").
"""
from __future__ import annotations

from functools import cache

import numpy as np

from .cpu_expert import LayoutError
from .gptq import GptqGeometry, check_bits, pack_cols, unpack_cols

MARLIN_TILE = 16        # tensor-core tile edge: 16 K x 16 N
MARLIN_MIN_N = 64       # smallest thread_n
MARLIN_MIN_K = 128      # smallest thread_k that every tile config accepts


def check_marlin_shape(name: str, n: int, k: int, group_size: int) -> None:
    """Raise LayoutError naming `name` unless (N, K) can be tiled by the Marlin kernel as is."""
    problems = []
    if n % MARLIN_MIN_N:
        problems.append(f"N={n} is not a multiple of {MARLIN_MIN_N}")
    if k % MARLIN_MIN_K:
        problems.append(f"K={k} is not a multiple of {MARLIN_MIN_K}")
    if group_size != -1 and k % group_size:
        problems.append(f"K={k} is not a multiple of the group size {group_size}")
    if problems:
        raise LayoutError(f"tensor {name!r} of shape (N={n}, K={k}) cannot be tiled for Marlin: "
                          + "; ".join(problems))


def marlin_padded_shape(n: int, k: int, group_size: int) -> tuple[int, int]:
    """(N_pad, K_pad) after zero padding: N to a multiple of 64, K to a multiple of lcm(128, G)."""
    unit = MARLIN_MIN_K if group_size in (-1, 32, 64, 128) else np.lcm(MARLIN_MIN_K, group_size)
    return -(-n // MARLIN_MIN_N) * MARLIN_MIN_N, -(-k // unit) * unit


@cache
def weight_perm(bits: int) -> np.ndarray:
    """Permutation of 1024 values (16 K x 64 N, as four row-major 16x16 tiles) into Marlin fragment order."""
    check_bits(bits)
    order = []
    for thread in range(32):
        col = thread // 4
        rows = [2 * (thread % 4), 2 * (thread % 4) + 1, 2 * (thread % 4) + 8, 2 * (thread % 4) + 9]
        per_thread = [16 * r + col + 8 * half for half in (0, 1) for r in rows]
        for tile in range(4):
            order.extend(p + 256 * tile for p in per_thread)
    inter = np.array([0, 2, 4, 6, 1, 3, 5, 7] if bits == 4 else [0, 2, 1, 3])
    perm = np.array(order).reshape(-1, len(inter))[:, inter].ravel()
    perm.setflags(write=False)
    return perm


@cache
def scale_perms() -> tuple[np.ndarray, np.ndarray]:
    """(grouped: 64 entries, single group: 32 entries) column orders of the scales."""
    grouped = np.array([i + 8 * j for i in range(8) for j in range(8)])
    single = np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])
    return grouped, single


def qweight_kn(qweight_shape, bits: int) -> tuple[int, int]:
    """(K, N) of a Marlin qweight of shape (K/16, N*16*bits/32) (padded sizes, as stored)."""
    return qweight_shape[0] * MARLIN_TILE, qweight_shape[1] * 32 // (MARLIN_TILE * bits)


def _tiled(k: int, n: int) -> tuple[int, int]:
    return k // MARLIN_TILE, n * MARLIN_TILE


def pack_weight(codes_kn: np.ndarray, bits: int, name: str = "weight") -> np.ndarray:
    """codes (K, N) uint8 -> qweight (K/16, N*16*bits/32) int32."""
    k, n = codes_kn.shape
    check_marlin_shape(name, n, k, -1)
    t = codes_kn.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(_tiled(k, n))
    perm = weight_perm(bits)
    # np.take along an axis, not fancy indexing [:, perm]: the same bytes, ~20x faster on a 10^8-code matrix
    t = np.take(t.reshape(-1, perm.size), perm, axis=1).reshape(_tiled(k, n))
    return pack_cols(t, bits)


def unpack_weight(qweight: np.ndarray, k: int, n: int, bits: int) -> np.ndarray:
    """qweight (K/16, N*16*bits/32) int32 -> codes (K, N) uint8."""
    t = unpack_cols(qweight, bits)
    if t.shape != _tiled(k, n):
        raise LayoutError(f"marlin qweight {qweight.shape} does not match K={k}, N={n}, bits={bits}")
    perm = weight_perm(bits)
    inv = np.empty_like(t.reshape(-1, perm.size))
    inv[:, perm] = t.reshape(-1, perm.size)
    return inv.reshape(k // 16, n // 16, 16, 16).transpose(0, 2, 1, 3).reshape(k, n)


def grouped_scales(k: int, group_size: int) -> bool:
    """Whether scales of a K-deep Linear use `scale_perm` (several groups) rather than `scale_perm_single`."""
    return group_size != -1 and group_size < k


def _scale_perm_for(k: int, group_size: int) -> np.ndarray:
    grouped, single = scale_perms()
    return grouped if grouped_scales(k, group_size) else single


def pack_scales(scales_gn: np.ndarray, k: int, group_size: int) -> np.ndarray:
    """scales (n_groups, N) -> (n_groups, N) float16 in Marlin order."""
    s = np.asarray(scales_gn, dtype=np.float16)
    perm = _scale_perm_for(k, group_size)
    return np.ascontiguousarray(s.reshape(-1, perm.size)[:, perm].reshape(s.shape))


def unpack_scales(scales: np.ndarray, k: int, group_size: int) -> np.ndarray:
    s = np.asarray(scales, dtype=np.float16)
    perm = _scale_perm_for(k, group_size)
    out = np.empty_like(s.reshape(-1, perm.size))
    out[:, perm] = s.reshape(-1, perm.size)
    return out.reshape(s.shape)


def marlin_pack(codes_kn: np.ndarray, scales_gn: np.ndarray, geom: GptqGeometry, name: str = "weight"
                ) -> dict[str, np.ndarray]:
    """codes (K, N), scales (n_groups, N) -> {qweight, scales} in the Marlin layout (shape checked)."""
    check_marlin_shape(name, geom.n, geom.k, geom.group_size)
    if codes_kn.shape != (geom.k, geom.n) or scales_gn.shape != geom.scales_shape:
        raise LayoutError(f"{name}: codes {codes_kn.shape} / scales {scales_gn.shape} do not match {geom}")
    return {"qweight": pack_weight(codes_kn, geom.bits, name), "scales": pack_scales(scales_gn, geom.k, geom.group_size)}


def marlin_unpack(tensors: dict[str, np.ndarray], geom: GptqGeometry) -> tuple[np.ndarray, np.ndarray]:
    """-> codes (K, N) uint8, scales (n_groups, N) float16."""
    return (unpack_weight(tensors["qweight"], geom.k, geom.n, geom.bits),
            unpack_scales(tensors["scales"], geom.k, geom.group_size))
