"""Routed experts of the CPU tiles in a GPU Linear format, losslessly: the codes and scales of the stored tiles
regrouped for a GPU format of the registry (ktlayouts.gpu_formats), with nothing re-quantized.

The CPU tiles hold symmetric per-group codes with zero point 2^(bits-1) (ktlayouts.cpu_expert):
    W[n, k] = (code[n, k] - 2^(bits-1)) * scale[n, k // G]
which is exactly GPTQ's sym=True / compressed-tensors' symmetric int / Marlin's uint4b8 / uint8b128. Used by
`ktconvert export` (every expert into a checkpoint) and by ktrun's hot experts (a few experts on the GPU).

Group length on the GPU ("step"): GPU formats need one group length that divides K of every projection (H for
gate/up, I for down). The CPU group G can be longer than K (G=128, H=96) or end in a partial group, and with
per-row scales and several NUMA shards every down shard has its own per-row scale. So the step is the largest of
(128, 64, 32) that divides H and I such that every step-long run of columns lies inside one CPU group; each CPU
scale is written once per step-long run it covers (still exact). When every row of every projection has one scale
(per-row codes, or G >= K), the step is CHANNEL (one scale per row). Otherwise there is none (e.g. I = 80 with
G = 64): `gpu_group_step` returns None.
"""
from __future__ import annotations

import numpy as np

from .converted_dir import PROJECTIONS, ExpertGeometry
from .cpu_expert import LayoutError, unpack_codes, unpack_scales
from .expert_shards import paste_shard
from .gptq import GptqGeometry
from .gpu_formats import gpu_format_for

GPU_STEPS = (128, 64, 32)           # the group lengths (besides per-row) Marlin kernels and the engines take
CHANNEL = -1                        # step meaning one scale per output row
HOT_FORMATS = ("marlin", "gptq", "bf16")    # how ktrun keeps hot experts on the GPU
# the parts a hot-expert slot holds, where not all of the format's (gptq: codes and scales for ktrun's Triton kernel;
# the zero points are the symmetric constant and the groups are in order, so no qzeros, no g_idx)
HOT_PARTS = {"gptq": ("qweight", "scales")}


def source_shape(geo: ExpertGeometry, proj: str) -> tuple[int, int]:
    """(N, K) of the source Linear: gate/up (I, H), down (H, I)."""
    return (geo.hidden, geo.intermediate) if proj == "down" else (geo.intermediate, geo.hidden)


def shard_offsets(geo: ExpertGeometry, proj: str) -> list[tuple[int, int]]:
    """(first output row n0, first input column k0) of each shard in the source matrix: gate/up shards split N = I,
    down shards split K = I (expert_shards' ranges)."""
    return [(0, i0) if proj == "down" else (i0, 0) for i0, _i1 in geo.shard_plan.shard_ranges()]


def column_groups(geo: ExpertGeometry, proj: str) -> np.ndarray:
    """(K,) int64: an id of the CPU scale group each source input column belongs to (same id, same scale)."""
    _n, k = source_shape(geo, proj)
    ids, first_id = np.empty(k, dtype=np.int64), 0
    for s, (_n0, k0) in enumerate(shard_offsets(geo, proj)):
        geom = geo.matrix_geometry(proj, s)
        k1 = min(k, k0 + geom.k)
        cols = np.arange(k0, k1)
        ids[cols] = first_id + (cols - k0) // geom.group
        first_id += geom.n_groups
        if proj != "down":
            break                   # gate/up: every shard has the same column groups (K = H is not split)
    return ids


def gpu_group_step(geo: ExpertGeometry) -> int | None:
    """The GPU group length that keeps the CPU scales exact (CHANNEL for one scale per row); None if there is none
    (or the experts are bf16, which have no codes)."""
    if not geo.format.quantized:
        return None
    groups = {p: column_groups(geo, p) for p in PROJECTIONS}
    if all(np.all(g == g[0]) for g in groups.values()):
        return CHANNEL
    for step in GPU_STEPS:
        if all(len(g) % step == 0 and np.all(g.reshape(-1, step) == g.reshape(-1, step)[:, :1])
               for g in groups.values()):
            return step
    return None


def expert_codes(geo: ExpertGeometry, proj: str, step: int, shards: list[tuple[np.ndarray, np.ndarray]]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """One expert projection's stored tiles, per shard (qweight (NB, KT, TB), packed scales (NB, n_groups, 16)) ->
    codes (N, K) uint8 (zero point 2^(bits-1)) and scales (N, K / step) float32 ((N, 1) for CHANNEL) in source
    shape."""
    n, k = source_shape(geo, proj)
    step_k = k if step == CHANNEL else step
    codes = np.empty((n, k), dtype=np.uint8)
    scales = np.empty((n, k // step_k), dtype=np.float32)
    for s, ((q, sc_packed), (n0, k0)) in enumerate(zip(shards, shard_offsets(geo, proj))):
        geom = geo.matrix_geometry(proj, s)
        c, sc = unpack_codes(q, geom), unpack_scales(sc_packed, geom)      # (N_pad, K_pad), (N_pad, n_groups)
        paste_shard(c, proj, geo.shard_plan, s, codes)
        n1, k1 = min(n, n0 + geom.n), min(k, k0 + geom.k)
        first = np.arange(k0, k1, step_k)                                  # first column of each GPU group
        scales[n0:n1, first // step_k] = sc[: n1 - n0, (first - k0) // geom.group]
    return codes, scales


def gptq_geometry(geo: ExpertGeometry, proj: str, step: int) -> GptqGeometry:
    """The (N, K) GptqGeometry of one projection at `step` (LayoutError when the GPU layouts cannot hold it)."""
    n, k = source_shape(geo, proj)
    return GptqGeometry(n, k, geo.bits, step)


def hot_format_ok(geo: ExpertGeometry, family: str) -> str | None:
    """None when `family` ('marlin' | 'bf16') can hold these experts exactly, else why not."""
    if family == "bf16":
        return None
    if family not in HOT_FORMATS:
        return f"unknown hot-expert format {family!r}: choose one of {', '.join(HOT_FORMATS)}"
    if not geo.format.quantized:
        return f"the experts are {geo.format.name} (no int codes for Marlin)"
    step = gpu_group_step(geo)
    if step is None:
        return (f"no GPU group length in {GPU_STEPS} divides hidden {geo.hidden} and intermediate {geo.intermediate} "
                f"inside the CPU groups of {geo.group_size}")
    try:
        for p in PROJECTIONS:
            fmt = gpu_format_for(family, geo.bits)
            n, k = source_shape(geo, p)
            fmt.storage_geometry(n, k, step)
    except LayoutError as e:
        return str(e)
    return None


def hot_expert_nbytes(geo: ExpertGeometry, family: str, biases: bool = False) -> int:
    """Device bytes of one expert (gate + up + down) in a hot-expert format: 'bf16' (dense, 2 bytes a weight) or
    'marlin' / 'gptq' (the registry's stored parts a slot holds, at the exact step); biases: the family's experts
    carry gate/up/down biases (gpt-oss), held as float32 beside the weights (4 * (2I + H) bytes)."""
    bias_bytes = 4 * sum(source_shape(geo, p)[0] for p in PROJECTIONS) if biases else 0
    if family == "bf16":
        return bias_bytes + sum(2 * n * k for n, k in (source_shape(geo, p) for p in PROJECTIONS))
    why = hot_format_ok(geo, family)
    if why:
        raise LayoutError(f"experts cannot be held as {family}: {why}")
    fmt, step, total = gpu_format_for(family, geo.bits), gpu_group_step(geo), bias_bytes
    for p in PROJECTIONS:
        n, k = source_shape(geo, p)
        for suffix, dtype, shape in fmt.part_shapes(fmt.storage_geometry(n, k, step)):
            if suffix not in HOT_PARTS.get(family, (suffix,)):
                continue
            total += int(np.prod(shape)) * np.dtype({"I32": np.int32, "F16": np.float16, "F32": np.float32,
                                                     "I64": np.int64}[dtype]).itemsize
    return total
