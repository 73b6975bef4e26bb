"""NUMA sharding of routed experts along the intermediate dimension I.

Every expert is split into S shards over I: shard s holds gate/up rows [i0, i1) and down columns [i0, i1), so
out = sum_s down_s(silu(gate_s x) * up_s x). Boundaries sit on multiples of the unit U = lcm(64, G) (64 for per-row
scales, lcm(64, 8 G) = 256 for two-level scales), which is a tile boundary for gate/up (N) and a tile *and group*
(and super-block) boundary for down (K). I is padded with
zeros to I_pad = round_up(I, U); padded rows give silu(0) * 0 = 0 and contribute nothing.

Serving files written for S shards on M NUMA nodes (see README.md): M == S one shard per node; M < S node m takes the
shards s with s * M // S == m; M > S a shard's unit range [u0, u1) can be split further between nodes, because every
unit is self-contained (whole gate/up tiles, whole down tiles and groups), addressed with the shard's strides.

Cutting, in one place: `cut_shard` / `paste_shard` take a shard's rows (gate/up) or columns (down) out of, or back
into, a source-shaped matrix (float weights, codes, scales), padding to the unit boundary; `shard_matrices` and
`shard_codes` do it for a whole expert, `join_shards` undoes it for dequantized shards; `unit_piece` cuts units
[u0, u1) of a shard straight from the packed bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .cpu_expert import LayoutError, MatrixGeometry, k_unit, round_up
from .expert_formats import (
    GROUP_PER_ROW,
    TILE_N,
    UNDECLARED_SCALE_DTYPE,
    ExpertFormat,
    expert_format_of_bits,
    scale_encoding,
)


@dataclass(frozen=True)
class ShardPlan:
    intermediate: int       # I of the source
    group_size: int         # G for the int layouts (ignored for bf16)
    n_shards: int           # S
    bits: int = 8
    scale_dtype: str = UNDECLARED_SCALE_DTYPE   # two-level scales (sub6) cut on super-block boundaries

    def __post_init__(self):
        self.format.check(self.group_size, self.scale_dtype)
        if self.n_shards < 1:
            raise LayoutError(f"--numa-nodes must be >= 1, got {self.n_shards}")
        if self.n_shards > self.n_units:
            raise LayoutError(
                f"cannot split intermediate size {self.intermediate} into {self.n_shards} NUMA shards: it has only "
                f"{self.n_units} unit(s) of {self.unit} (lcm of tile 64 and group {self.group_size}{self._record_words}"
                "); use fewer --numa-nodes")

    @property
    def _record_words(self) -> str:
        n = scale_encoding(self.scale_dtype).super_groups if self.format.quantized else 1
        return f", super-block {n} groups" if n > 1 else ""

    @property
    def format(self) -> ExpertFormat:
        return expert_format_of_bits(self.bits)

    @property
    def unit(self) -> int:
        return k_unit(self.bits, self.group_size, self.scale_dtype)

    @property
    def intermediate_pad(self) -> int:
        return round_up(self.intermediate, self.unit)

    @property
    def n_units(self) -> int:
        return self.intermediate_pad // self.unit

    def shard_range(self, s: int) -> tuple[int, int]:
        """[i0, i1) in padded intermediate coordinates."""
        u0 = s * self.n_units // self.n_shards
        u1 = (s + 1) * self.n_units // self.n_shards
        return u0 * self.unit, u1 * self.unit

    def shard_ranges(self) -> list[tuple[int, int]]:
        return [self.shard_range(s) for s in range(self.n_shards)]

    def gate_up_geometry(self, s: int, hidden: int) -> MatrixGeometry:
        i0, i1 = self.shard_range(s)
        return MatrixGeometry(n=i1 - i0, k=hidden, bits=self.bits, group_size=self.group_size,
                              scale_dtype=self.format.scale_dtype_of(self.scale_dtype))

    def down_geometry(self, s: int, hidden: int) -> MatrixGeometry:
        i0, i1 = self.shard_range(s)
        return MatrixGeometry(n=hidden, k=i1 - i0, bits=self.bits, group_size=self.group_size,
                              scale_dtype=self.format.scale_dtype_of(self.scale_dtype))


def nodes_for_shards(n_shards: int, n_nodes: int) -> list[list[tuple[int, float, float]]]:
    """Assign shards written for S nodes to M nodes: per node, a list of (shard, frac_begin, frac_end) pieces."""
    if n_nodes < 1:
        raise LayoutError(f"number of NUMA nodes must be >= 1, got {n_nodes}")
    if n_nodes <= n_shards:
        out = [[] for _ in range(n_nodes)]
        for s in range(n_shards):
            out[s * n_nodes // n_shards].append((s, 0.0, 1.0))
        return out
    out = []
    for m in range(n_nodes):
        s = m * n_shards // n_nodes
        first = next(j for j in range(n_nodes) if j * n_shards // n_nodes == s)
        count = sum(1 for j in range(n_nodes) if j * n_shards // n_nodes == s)
        out.append([(s, (m - first) / count, (m - first + 1) / count)])
    return out


# --- cutting a shard out of an expert (and back) ------------------------------------------------------------------

def _split_axis(proj: str) -> int:
    """The axis of a (N, K) projection that runs over I: rows of gate/up (N = I), columns of down (K = I)."""
    return 1 if proj == "down" else 0


def _extent(plan: ShardPlan, shard: int, per: int, what: str) -> tuple[int, int, int]:
    """(first entry, entries in the shard, entries that exist in the source) along I, in units of `per` positions."""
    i0, i1 = plan.shard_range(shard)
    take = max(0, min(i1, plan.intermediate) - i0)
    if i0 % per or (i1 - i0) % per or take % per:
        raise LayoutError(f"{what}: shard {shard} [{i0}, {i1}) of I={plan.intermediate} is not whole entries of {per}")
    return i0 // per, (i1 - i0) // per, take // per


def cut_shard(a: np.ndarray, proj: str, plan: ShardPlan, shard: int, fill=0, per: int = 1) -> np.ndarray:
    """The shard's part of one source-shaped expert projection, padded with `fill` past the source's I.

    a: gate/up (I / per, X) -> rows of the shard (width / per, X); down (X, I / per) -> columns (X, width / per).
    per: I positions per entry along that axis (1 for weights and codes, G for down's scales (H, I / G)).
    No padding needed: a view (the packers copy anyway).
    """
    axis = _split_axis(proj)
    first, width, take = _extent(plan, shard, per, proj)
    idx = [slice(None)] * 2
    idx[axis] = slice(first, first + take)
    if take == width:
        return a[tuple(idx)]
    shape = list(a.shape)
    shape[axis] = width
    out = np.full(shape, fill, dtype=a.dtype)
    dst = [slice(None)] * 2
    dst[axis] = slice(0, take)
    out[tuple(dst)] = a[tuple(idx)]
    return out


def paste_shard(piece: np.ndarray, proj: str, plan: ShardPlan, shard: int, out: np.ndarray, per: int = 1) -> None:
    """Inverse of cut_shard: the source part of a shard-shaped `piece` (padding dropped, and anything past `out`'s
    other dimension, e.g. padded tile rows) written into the source-shaped `out`."""
    axis = _split_axis(proj)
    first, _width, take = _extent(plan, shard, per, proj)
    other = out.shape[1 - axis]
    src, dst = [slice(None)] * 2, [slice(None)] * 2
    src[axis], dst[axis] = slice(0, take), slice(first, first + take)
    src[1 - axis] = dst[1 - axis] = slice(0, other)
    out[tuple(dst)] = piece[tuple(src)]


def join_shards(per_shard: list[dict[str, np.ndarray]], intermediate: int) -> dict[str, np.ndarray]:
    """Every shard's dequantized matrices (shard order; padded coordinates) -> the source-shaped expert: gate/up
    (I, H), down (H, I). Shards are consecutive ranges of I, so they concatenate; the padding past I is dropped."""
    out = {}
    for p in per_shard[0]:
        axis = _split_axis(p)
        m = np.concatenate([s[p] for s in per_shard], axis=axis)
        out[p] = m[:, :intermediate] if axis else m[:intermediate]
    return out


def shard_matrices(w: dict[str, np.ndarray], plan: ShardPlan, shard: int) -> dict[str, np.ndarray]:
    """One expert's float gate/up (I, H) and down (H, I) -> the shard's matrices, zero-padded to the unit boundary."""
    return {p: cut_shard(m, p, plan, shard, fill=0) for p, m in w.items()}


def shard_codes(exact: dict[str, tuple[np.ndarray, np.ndarray]], plan: ShardPlan, shard: int
                ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One expert's already-quantized {proj: (codes (N, K) uint8, scales (N, K / G))} in source shape -> the shard's,
    padded with code ZERO and scale 0 (weight 0)."""
    if not plan.format.quantized or plan.group_size == GROUP_PER_ROW:
        raise LayoutError(f"already-quantized codes need int groups, not bits={plan.bits} group {plan.group_size}")
    z = plan.format.zero_point
    out = {}
    for p, (codes, scales) in exact.items():
        per = plan.group_size if p == "down" else 1        # down's scales run over I in groups of G
        out[p] = (cut_shard(codes, p, plan, shard, fill=z), cut_shard(scales, p, plan, shard, fill=0.0, per=per))
    return out


def unit_piece(qweight: np.ndarray, scales: np.ndarray | None, proj: str, shard_geom: MatrixGeometry, unit: int,
               u0: int, u1: int, stacked: bool = False) -> tuple[np.ndarray, np.ndarray | None, MatrixGeometry]:
    """Units [u0, u1) (counted inside the shard) of one shard's packed projection, cut from the bytes (views).

    qweight (NB, KT, TB) and scales (NB, n_groups, 16) or None (bf16) as stored for one expert, shard_geom their
    MatrixGeometry, unit = ShardPlan.unit; stacked: with the leading expert axis of the files (E, ...). gate/up keep
    whole 16-row column blocks, down whole K tiles and scale groups (a unit is a multiple of both; per-row scales
    are the shard's, shared by all its units), so nothing is repacked: this is how files written for S NUMA nodes
    serve on more nodes. -> (qweight, scales, MatrixGeometry of the piece).
    """
    g, rows = shard_geom, (u1 - u0) * unit
    lead = (slice(None),) if stacked else ()
    if proj != "down":
        blocks = lead + (slice(u0 * unit // TILE_N, u1 * unit // TILE_N),)
        return (qweight[blocks], None if scales is None else scales[blocks],
                replace(g, n=rows))
    q = qweight[lead + (slice(None), slice(u0 * unit // g.k_per_tile, u1 * unit // g.k_per_tile))]
    if scales is not None and g.group_size != GROUP_PER_ROW:
        scales = scales[lead + (slice(None), slice(u0 * unit // g.group, u1 * unit // g.group))]
    return q, scales, replace(g, k=rows)
