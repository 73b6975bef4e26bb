"""Routed experts of a conversion, taken over losslessly into a GPU checkpoint format for `ktconvert export`.

The CPU tiles hold symmetric per-group codes with zero point 2^(bits-1) (ktlayouts.cpu_expert):
    W[n, k] = (code[n, k] - 2^(bits-1)) * scale[n, k // G]
which is exactly compressed-tensors' symmetric int quantization (pack-quantized) and GPTQ's sym=True, desc_act=False
(ktlayouts.compressed_tensors / ktlayouts.gptq). So the codes are unpacked from the tiles, cropped to the source
shape (N, K) and repacked with those layouts' pack functions; no value is re-quantized. Scales stay float32, as
the tiles store them (the layouts' usual float16 would round them).

Export group size ("step"): the consumers need one group length that divides K of every projection (H for
gate/up, I for down; compressed-tensors' dequantization refuses K % group != 0). The CPU group G can be longer than
K (G=128, H=96) or end in a partial group, and with --group-size -1 and several NUMA shards every down shard has
its own per-row scale. So the export uses the largest step in (128, 64, 32) that divides H and I such that every
step-long run of columns lies inside one CPU group, and writes each CPU scale once per step-long run it covers
(still exact). When every row of every projection has one scale (per-row codes, or G >= K), the export keeps one
scale per row (compressed-tensors strategy "channel", GPTQ group_size -1). Otherwise there is no exact step (e.g.
I = 80 with G = 64) and the export refuses, pointing to --experts bf16.

transformers (5.24, CPU) keeps the dequantized experts in the scales' dtype (float32) even when loading with
dtype=bfloat16 (its fused-expert decompression does not cast, its dense path does); forward passes work.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from ktlayouts.compressed_tensors import ct_pack
from ktlayouts.converted_dir import PROJECTIONS, expert_file, expert_tensor
from ktlayouts.cpu_expert import LayoutError, MatrixGeometry, unpack_codes, unpack_scales
from ktlayouts.gptq import GptqGeometry, gptq_pack

from ktconvert.converted_reader import ConvertedDir, to_numpy

EXPORT_STEPS = (128, 64, 32)           # the group lengths (besides per-row) vLLM's Marlin kernels take
CHANNEL = -1                           # step meaning one scale per output row
# The per-expert Linears (model.layers.N.mlp.experts.E.gate_proj, Mixtral's block_sparse_moe.experts.E.w1), not
# shared_experts: a compressed-tensors target (re.match on the module name) and a gptq `dynamic` key.
EXPERT_TARGET_REGEX = r"re:.*\.experts\.\d+\.[^.]+$"
EXPERT_DYNAMIC = r"+:.*\.experts\.\d+\.[^.]+$"


class ExpertExportError(ValueError):
    """Routed experts that cannot be written in a GPU format without re-quantizing."""


@dataclass(frozen=True)
class ShardPiece:
    """Where one stored shard of one projection sits in the source-shaped (N, K) matrix."""
    shard: int
    geom: MatrixGeometry    # the shard's tile geometry (padded)
    n0: int                 # first output row (gate/up shards split N = I)
    k0: int                 # first input column (down shards split K = I)


def shard_pieces(conv: ConvertedDir, proj: str) -> list[ShardPiece]:
    geo = conv.geometry
    out = []
    for s, (i0, _i1) in enumerate(geo.shard_plan.shard_ranges()):
        geom = geo.matrix_geometry(proj, s)
        out.append(ShardPiece(s, geom, 0 if proj == "down" else i0, i0 if proj == "down" else 0))
    return out


def source_shape(conv: ConvertedDir, proj: str) -> tuple[int, int]:
    """(N, K) of the source Linear: gate/up (I, H), down (H, I)."""
    h, i = conv.geometry.hidden, conv.geometry.intermediate
    return (h, i) if proj == "down" else (i, h)


def column_groups(conv: ConvertedDir, proj: str) -> np.ndarray:
    """(K,) int64: an id of the CPU scale group each source input column belongs to (same id, same scale)."""
    _n, k = source_shape(conv, proj)
    ids, first_id = np.empty(k, dtype=np.int64), 0
    for p in shard_pieces(conv, proj):
        k1 = min(k, p.k0 + p.geom.k)
        cols = np.arange(p.k0, k1)
        ids[cols] = first_id + (cols - p.k0) // p.geom.group
        first_id += p.geom.n_groups
        if proj != "down":
            break                   # gate/up: every shard has the same column groups (K = H is not split)
    return ids


def export_step(conv: ConvertedDir) -> int:
    """The group length the export writes (CHANNEL for one scale per row); ExpertExportError if none is exact."""
    groups = {p: column_groups(conv, p) for p in PROJECTIONS}
    if all(np.all(g == g[0]) for g in groups.values()):
        return CHANNEL
    for step in EXPORT_STEPS:
        if all(len(g) % step == 0 and np.all(g.reshape(-1, step) == g.reshape(-1, step)[:, :1])
               for g in groups.values()):
            return step
    geo = conv.geometry
    raise ExpertExportError(
        f"the routed experts (group size {geo.group_size}, {geo.numa_nodes} NUMA shard(s), hidden {geo.hidden}, "
        f"intermediate {geo.intermediate}) have no group length in {EXPORT_STEPS} that divides both sizes and "
        "stays inside the CPU scale groups; export them with --experts bf16")


def expert_codes(conv: ConvertedDir, layer: int, expert: int, proj: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    """codes (N, K) uint8 (zero point 2^(bits-1)) and scales (N, K / step) float32 (N, 1) for CHANNEL of one expert
    projection in source shape, straight from the stored tiles."""
    n, k = source_shape(conv, proj)
    step_k = k if step == CHANNEL else step
    codes = np.empty((n, k), dtype=np.uint8)
    scales = np.empty((n, k // step_k), dtype=np.float32)
    for p in shard_pieces(conv, proj):
        f = conv.open(expert_file(layer, p.shard, conv.geometry.numa_nodes))
        q = f.get_slice(expert_tensor(proj, "qweight"))[expert: expert + 1][0].numpy()
        s = to_numpy(f.get_slice(expert_tensor(proj, "scales"))[expert: expert + 1][0])
        c, sc = unpack_codes(q, p.geom), unpack_scales(s, p.geom)          # (N_pad, K_pad), (N_pad, n_groups)
        n1, k1 = min(n, p.n0 + p.geom.n), min(k, p.k0 + p.geom.k)
        codes[p.n0:n1, p.k0:k1] = c[: n1 - p.n0, : k1 - p.k0]
        first = np.arange(p.k0, k1, step_k)                                # first column of each export group
        scales[p.n0:n1, first // step_k] = sc[: n1 - p.n0, (first - p.k0) // p.geom.group]
    return codes, scales


def gptq_geometry(conv: ConvertedDir, proj: str, step: int) -> GptqGeometry:
    n, k = source_shape(conv, proj)
    try:
        return GptqGeometry(n, k, conv.geometry.bits, step)
    except LayoutError as e:
        raise ExpertExportError(f"routed expert {proj} ({n}, {k}): {e}; export the experts with --experts bf16") \
            from None


def pack_expert(fmt: str, codes: np.ndarray, scales: np.ndarray, geom: GptqGeometry) -> dict[str, np.ndarray]:
    """codes (N, K), scales (N, n_groups) float32 -> the Linear's tensors in `fmt` (suffix -> array), scales f32."""
    codes_kn, scales_gn = np.ascontiguousarray(codes.T), np.ascontiguousarray(scales.T)
    if fmt == "compressed-tensors":
        parts = ct_pack(codes_kn, scales_gn, geom)
        parts["weight_scale"] = np.ascontiguousarray(scales, dtype=np.float32)        # (N, n_groups)
    elif fmt == "gptq":
        parts = gptq_pack(codes_kn, scales_gn, geom)
        parts["scales"] = np.ascontiguousarray(scales_gn, dtype=np.float32)           # (n_groups, N)
    else:
        raise ExpertExportError(f"no quantized expert export for GPU format {fmt!r}")
    return parts


def quantized_expert_tensors(conv: ConvertedDir, adapter, fmt: str) -> Iterator[tuple[str, np.ndarray]]:
    """Every routed expert Linear in `fmt`: (hub name of the part, array), e.g. ...experts.3.gate_proj.weight_packed."""
    geo = conv.geometry
    if geo.bits == 16:
        raise ExpertExportError("the conversion stores BF16 experts (--method bf16); export them with --experts bf16")
    step = export_step(conv)
    geoms = {p: gptq_geometry(conv, p, step) for p in PROJECTIONS}
    for layer in geo.moe_layers:
        for e in range(geo.n_experts):
            for p in PROJECTIONS:
                base = adapter.expert_tensor_name(layer, e, p).removesuffix(".weight")
                codes, scales = expert_codes(conv, layer, e, p, step)
                for suffix, arr in pack_expert(fmt, codes, scales, geoms[p]).items():
                    yield f"{base}.{suffix}", arr


def add_expert_scheme(qc: dict, fmt: str, bits: int, step: int) -> dict:
    """The exported quantization_config (a copy of `qc`, the GPU layers' own) plus the experts' scheme:
    compressed-tensors: a second config group whose regex target names the per-expert Linears (a regex outranks
    the GPU layers' class target "Linear" in compressed-tensors, vLLM and transformers alike);
    gptq: a positive `dynamic` override with the experts' bits and group size (vLLM / GPTQModel)."""
    qc = json.loads(json.dumps(qc))                     # deep copy
    if fmt == "compressed-tensors":
        dense = next(iter(qc["config_groups"].values()))
        weights = dict(dense["weights"], num_bits=bits, type="int", symmetric=True, dynamic=False, actorder=None,
                       strategy="channel" if step == CHANNEL else "group",
                       group_size=None if step == CHANNEL else step)
        name = f"group_{len(qc['config_groups'])}"
        qc["config_groups"][name] = {"targets": [EXPERT_TARGET_REGEX], "weights": weights, "input_activations": None,
                                     "output_activations": None, "format": "pack-quantized"}
    elif fmt == "gptq":
        dynamic = dict(qc.get("dynamic") or {})
        dynamic[EXPERT_DYNAMIC] = {"bits": bits, "group_size": step}
        qc["dynamic"] = dynamic
    else:
        raise ExpertExportError(f"no quantized expert export for GPU format {fmt!r}")
    return qc
