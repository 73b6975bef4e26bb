"""NUMA sharding of routed experts along the intermediate dimension I.

Every expert is split into S shards over I: shard s holds gate/up rows [i0, i1) and down columns [i0, i1), so
out = sum_s down_s(silu(gate_s x) * up_s x). Boundaries sit on multiples of the unit U = lcm(64, G) (64 for per-row
scales), which is a tile boundary for gate/up (N) and a tile *and group* boundary for down (K). I is padded with
zeros to I_pad = round_up(I, U); padded rows give silu(0) * 0 = 0 and contribute nothing.

Serving files written for S shards on M NUMA nodes (see README.md): M == S one shard per node; M < S node m takes the
shards s with s * M // S == m; M > S a shard's unit range [u0, u1) can be split further between nodes, because every
unit is self-contained (whole gate/up tiles, whole down tiles and groups), addressed with the shard's strides.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cpu_expert import LayoutError, MatrixGeometry, check_group_size, group_unit, round_up


@dataclass(frozen=True)
class ShardPlan:
    intermediate: int       # I of the source
    group_size: int         # G for the int layouts (ignored for bf16)
    n_shards: int           # S
    bits: int = 8

    def __post_init__(self):
        if self.bits != 16:
            check_group_size(self.group_size)
        if self.n_shards < 1:
            raise LayoutError(f"--numa-nodes must be >= 1, got {self.n_shards}")
        if self.n_shards > self.n_units:
            raise LayoutError(
                f"cannot split intermediate size {self.intermediate} into {self.n_shards} NUMA shards: it has only "
                f"{self.n_units} unit(s) of {self.unit} (lcm of tile 64 and group {self.group_size}); use fewer --numa-nodes")

    @property
    def unit(self) -> int:
        return 64 if self.bits == 16 else group_unit(self.group_size)

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
        return MatrixGeometry(n=i1 - i0, k=hidden, bits=self.bits, group_size=self.group_size)

    def down_geometry(self, s: int, hidden: int) -> MatrixGeometry:
        i0, i1 = self.shard_range(s)
        return MatrixGeometry(n=hidden, k=i1 - i0, bits=self.bits, group_size=self.group_size)


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
