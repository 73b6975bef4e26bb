"""Routed experts of a conversion for kt-kernel (`ktconvert export --for sglang-kt --kt-method M`).

    GPTQ_INT4  the export's own gptq experts (export.hf_experts, codes and scales of the CPU tiles) are what
               kt-kernel's GPTQ loader reads: exact. Needs an int4 conversion with --gpu-format gptq, and a group
               length in (128, 64, 32) that is exact for our groups and divides H and I/N (per-row codes are
               written with any such length, one scale repeated). kt-weight-path = the export itself.
    RAWINT4    the export's compressed-tensors experts with their scales stored as bf16, group 32: exact when every
               scale is a bf16 value (checked on the values; `ktconvert quantize --bf16-scales` makes it so).
               Needs an int4 conversion with --gpu-format compressed-tensors. kt-weight-path = the export itself.
    AMXINT4 /  kt-kernel's per-row tile dumps (ktlayouts.kt_kernel) in OUT/kt-experts/, one file per MoE layer,
    AMXINT8    N = --numa-nodes parts, codes -QMAX..QMAX (kt-kernel cannot take -2^(b-1), which our quantizer
               uses). Every row gets the step with the least squared error against the conversion's weights among
               the conversion's own grid (where the row has one scale within the part: every code but -2^(b-1)
               stays exact) and max|w| / QMAX x (1, 0.95, 0.9); the error against the conversion is measured for
               every matrix and reported.
Every size rule kt-kernel has (ktlayouts.kt_kernel.check_*) is checked before anything is written.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from ktlayouts.converted_dir import PROJECTIONS, expert_file, expert_tensor
from ktlayouts.cpu_expert import LayoutError, scales_to_f32, unpack_codes, unpack_scales
from ktlayouts.expert_formats import BF16_SCALES, expert_format_of_bits, expert_formats, scale_encoding
from ktlayouts.expert_shards import paste_shard
from ktlayouts.gpu_formats import GpuLinearFormat
from ktlayouts.kt_kernel import (
    AMX_METHOD_BITS,
    AMX_QMAX,
    AMX_SCALE_FACTOR,
    KT_METHOD_GPU_FORMAT,
    KT_METHODS,
    RAWINT4_GROUP,
    KtAlignmentError,
    amx_dequantize,
    amx_tensor_name,
    check_amx,
    check_gptq,
    check_parts,
    check_rawint4,
    pack_amx,
)

from ktconvert.converted_reader import ConvertedDir, to_numpy
from ktconvert.export.hf_experts import exact_steps, source_shape
from ktconvert.writer import AlignedWriter, TensorSpec

KT_EXPERT_DIR = "kt-experts"            # AMX methods: kt-weight-path inside the export
# per-expert names kt-kernel's loaders find: RAWINT4 only the DeepSeek/Qwen style, GPTQ_INT4 also Mixtral's
RAW_EXPERT_NAME = "model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
GPTQ_EXPERT_SUFFIXES = (".mlp.experts.{e}.{proj}_proj.weight", ".block_sparse_moe.experts.{e}.{w}.weight")
MIXTRAL_W = {"gate": "w1", "up": "w3", "down": "w2"}


class KtExportError(ValueError):
    """A conversion that cannot be exported for kt-kernel in the requested method (says which rule and why)."""


@dataclass
class KtPlan:
    """What the export writes for kt-kernel and where kt-kernel reads it."""
    method: str
    n_parts: int
    weight_dir: str                       # relative to the export: "." or KT_EXPERT_DIR
    expert_step: int | None = None        # GPTQ_INT4 / RAWINT4: the export's expert group length
    bf16_scales: bool = False             # RAWINT4
    report: dict = field(default_factory=dict)


def _codes_of(conv: ConvertedDir, method: str) -> None:
    """GPTQ_INT4 / RAWINT4 take the conversion's codes as they are: its experts must have the method's bits."""
    bits = KT_METHOD_GPU_FORMAT[method].bits
    if conv.geometry.bits != bits:
        raise KtExportError(f"{method} holds int{bits} codes, the conversion has {conv.geometry.bits}-bit experts "
                            f"({conv.geometry.method}); export it with --kt-method AMXINT8 (re-quantized per row) or "
                            f"reconvert with --method {expert_format_of_bits(bits).method}")


def _check_names(conv: ConvertedDir, adapter, method: str) -> None:
    layer = conv.geometry.moe_layers[0]
    names = {p: adapter.expert_tensor_name(layer, 0, p) for p in PROJECTIONS}
    raw = {p: RAW_EXPERT_NAME.format(layer=layer, e=0, proj=p) for p in PROJECTIONS}
    if method == "RAWINT4" and names != raw:
        raise KtExportError(f"RAWINT4: kt-kernel's RAWINT4 loader reads experts named like {raw['gate']}, this model "
                            f"names them like {names['gate']}; use --kt-method GPTQ_INT4 or AMXINT4")
    if method == "GPTQ_INT4":
        prefix = f"model.layers.{layer}"
        ok = [prefix + s.format(e=0, proj=p, w=MIXTRAL_W[p]) for s in GPTQ_EXPERT_SUFFIXES for p in ("gate",)]
        if names["gate"] not in ok:
            raise KtExportError(f"GPTQ_INT4: kt-kernel's GPTQ loader finds experts named like {' or '.join(ok)}, "
                                f"this model names them like {names['gate']}; use --kt-method AMXINT4")


def plan_kt_export(conv: ConvertedDir, config: dict, adapter, gpu_fmt: GpuLinearFormat | None, method: str,
                   n_parts: int) -> KtPlan:
    """Check everything kt-kernel needs before anything is written; KtExportError / KtAlignmentError say why not.
    gpu_fmt: the registered format of the conversion's GPU Linears (export.hf.gpu_format_of), None if none."""
    if method not in KT_METHODS:
        raise KtExportError(f"--kt-method {method!r}: choose one of {', '.join(KT_METHODS)}")
    geo = conv.geometry
    if not geo.format.quantized:
        quantized = " or ".join(f.method for f in sorted(expert_formats(), key=lambda f: f.bits) if f.quantized)
        raise KtExportError(f"the conversion stores unquantized experts (--method {geo.method}); kt-kernel's methods "
                            f"are quantized: reconvert with --method {quantized}")
    check_parts(geo.intermediate, n_parts)
    if method in AMX_METHOD_BITS:
        check_amx(geo.hidden, geo.intermediate, n_parts, AMX_METHOD_BITS[method])
        return KtPlan(method, n_parts, KT_EXPERT_DIR)
    _codes_of(conv, method)
    _check_names(conv, adapter, method)
    want = KT_METHOD_GPU_FORMAT[method]    # the experts' format; the GPU layers may be int8 of the same family
    if gpu_fmt is None or gpu_fmt.family != want.family:
        have = gpu_fmt.family if gpu_fmt is not None else "none (--gpu-method bf16)"
        raise KtExportError(f"{method}: kt-kernel reads the experts from the export's {want.family} tensors, and this "
                            f"conversion's GPU format is {have}; reconvert with --gpu-format {want.family}, or use "
                            "--kt-method AMXINT4")
    steps = exact_steps(conv)
    if method == "GPTQ_INT4":
        qc = config.get("quantization_config") or {}
        if qc.get("desc_act"):
            raise KtExportError("GPTQ_INT4: kt-kernel's GPTQ loader refuses desc_act=true in config.json (the GPU "
                                "layers were converted with --gpu-act-order); reconvert without it")
        errors = []
        for step in steps:
            try:
                check_gptq(geo.hidden, geo.intermediate, n_parts, step)
                return KtPlan(method, n_parts, ".", expert_step=step)
            except KtAlignmentError as e:
                errors.append(str(e))
        raise KtAlignmentError(
            f"GPTQ_INT4: no group length writes these experts exactly for kt-kernel (CPU group size "
            f"{geo.group_size}, hidden {geo.hidden}, intermediate {geo.intermediate}, {n_parts} NUMA part(s))"
            + (": " + "; ".join(errors) if errors else ": exact lengths are those in (128, 64, 32) that stay inside "
               "the CPU scale groups") + "; reconvert with --group-size 128, 64 or 32, or use --kt-method AMXINT4")
    if RAWINT4_GROUP not in steps:
        raise KtAlignmentError(
            f"RAWINT4: kt-kernel's default RAWINT4 kernel runs group {RAWINT4_GROUP}, and group-32 scales are not "
            f"exact for these experts (CPU group size {geo.group_size}, hidden {geo.hidden}, intermediate "
            f"{geo.intermediate}); reconvert with --group-size 32 --bf16-scales")
    check_rawint4(geo.hidden, geo.intermediate, n_parts, RAWINT4_GROUP)
    enc = scale_encoding(geo.scale_dtype)
    if not enc.elementwise:
        raise KtExportError(
            f"RAWINT4: kt-kernel's RAWINT4 reads one bf16 scale per group of 32, and {enc.what} (--scale-dtype "
            f"{enc.name}) are not stored value by value as bf16 (rounding them would change the weights); reconvert "
            "with `ktconvert quantize --group-size 32 --bf16-scales` (f16 or bf16 scales), or use --kt-method "
            f"GPTQ_INT4 (float32 scales, exact for {enc.what})")
    bad = non_bf16_scales(conv)
    if bad:
        raise KtExportError(
            f"RAWINT4: kt-kernel's RAWINT4 reads bf16 scales, and {bad} of this conversion's expert scales are not "
            "bf16 values (rounding them would change the weights); reconvert with `ktconvert quantize "
            "--bf16-scales` (scales rounded before quantizing), or use --kt-method GPTQ_INT4 (float32 scales)")
    return KtPlan(method, n_parts, ".", expert_step=RAWINT4_GROUP, bf16_scales=True)


def non_bf16_scales(conv: ConvertedDir) -> int:
    """How many stored expert scales are not exactly a bfloat16 value (checked on their float32 values; none with
    bf16-stored scales, layout version 2)."""
    geo, bad = conv.geometry, 0
    if geo.scale_dtype == BF16_SCALES.name:
        return 0
    for layer in geo.moe_layers:
        for s in range(geo.numa_nodes):
            f = conv.open(expert_file(layer, s, geo.numa_nodes))
            for p in PROJECTIONS:
                scales = scales_to_f32(to_numpy(f.get_tensor(expert_tensor(p, "scales"))), geo.scale_dtype)
                bad += int(np.count_nonzero(scales.view(np.uint32) & 0xFFFF))
    return bad


def source_codes(conv: ConvertedDir, layer: int, expert: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
    """codes (N, K) uint8 (zero point 2^(bits-1)) and per-column scales (N, K) float32 of one expert projection in
    source shape, from the stored tiles of every shard."""
    geo = conv.geometry
    n, k = source_shape(conv, proj)
    codes = np.empty((n, k), dtype=np.uint8)
    scales = np.empty((n, k), dtype=np.float32)
    for shard in range(geo.numa_nodes):
        geom = geo.matrix_geometry(proj, shard)
        f = conv.open(expert_file(layer, shard, geo.numa_nodes))
        q = f.get_slice(expert_tensor(proj, "qweight"))[expert: expert + 1][0].numpy()
        s = to_numpy(f.get_slice(expert_tensor(proj, "scales"))[expert: expert + 1][0])
        c, sc = unpack_codes(q, geom), unpack_scales(s, geom)              # (N_pad, K_pad), (N_pad, n_groups)
        col_sc = sc[:, np.arange(c.shape[1]) // geom.group]                # (N_pad, K_pad): each column's scale
        paste_shard(c, proj, geo.shard_plan, shard, codes)
        paste_shard(col_sc, proj, geo.shard_plan, shard, scales)
    return codes, scales


class ErrorStats:
    """Relative error of the exported weights against the conversion's: overall and worst matrix, per projection."""

    def __init__(self):
        self.num = {p: 0.0 for p in PROJECTIONS}
        self.den = {p: 0.0 for p in PROJECTIONS}
        self.worst = {p: 0.0 for p in PROJECTIONS}
        self.rows_kept = 0                 # rows on the conversion's own code grid (only -2^(b-1) codes moved)
        self.rows_refit = 0                # rows re-quantized on a new scale

    def add(self, proj: str, got: np.ndarray, ref: np.ndarray) -> None:
        d = float(np.square(got - ref, dtype=np.float64).sum())
        r = float(np.square(ref, dtype=np.float64).sum())
        self.num[proj] += d
        self.den[proj] += r
        self.worst[proj] = max(self.worst[proj], (d / r) ** 0.5 if r else 0.0)

    def to_json(self) -> dict:
        rel = {p: (self.num[p] / self.den[p]) ** 0.5 if self.den[p] else 0.0 for p in PROJECTIONS}
        return {"rel_error": rel, "worst_matrix_rel_error": dict(self.worst), "rows_on_conversion_grid": self.rows_kept,
                "rows_requantized": self.rows_refit}


REFIT_FRACTIONS = (1.0, 0.95, 0.9)       # candidate steps max|w| / QMAX * f for a re-quantized row


def fit_rows(ref: np.ndarray, bits: int, row_step: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row codes for kt-kernel (-QMAX..QMAX) of ref (n, k): for every row the step (value of one code) with the
    least squared error among row_step (the conversion's own grid, where it has one: NaN where not; on it every
    code but -2^(b-1) is exact) and max|w| / QMAX * REFIT_FRACTIONS. -> (q int8, kt scale (n,), kept (n,) bool)."""
    qmax = AMX_QMAX[bits]
    amax = np.abs(ref).max(axis=1)
    cands = [amax / np.float32(qmax) * np.float32(f) for f in REFIT_FRACTIONS]
    if row_step is not None:
        cands.insert(0, np.where(np.isnan(row_step), cands[0], row_step).astype(np.float32))
    best_q, best_step, best_err = None, None, None
    for step in cands:
        inv = np.divide(np.float32(1), step, out=np.zeros_like(step), where=step != 0)
        q = np.clip(np.rint(ref * inv[:, None]), -qmax, qmax)
        err = np.square(q * step[:, None] - ref, dtype=np.float64).sum(axis=1)
        if best_q is None:
            best_q, best_step, best_err, kept = q, step.copy(), err, np.zeros(len(step), bool)
            if row_step is not None:
                kept = ~np.isnan(row_step)
            continue
        better = err < best_err
        best_q[better], best_step[better], best_err[better], kept[better] = q[better], step[better], err[better], False
    return best_q.astype(np.int8), (best_step / np.float32(AMX_SCALE_FACTOR[bits])).astype(np.float32), kept


def amx_part(codes: np.ndarray, scales: np.ndarray, conv_bits: int, bits: int, rows: slice, cols: slice,
             stats: ErrorStats, proj: str) -> tuple[np.ndarray, np.ndarray]:
    """One kt part of one projection: (signed q (n, k), kt scale (n,)) from the conversion's codes/column scales."""
    c, sc = codes[rows, cols], scales[rows, cols]
    ref = (c.astype(np.float32) - expert_format_of_bits(conv_bits).zero_point) * sc      # the conversion's weights
    row_step = None
    if bits >= conv_bits:                     # the conversion's grid, refined 2^(bits - conv_bits) times
        one = np.all(sc == sc[:, :1], axis=1)
        row_step = np.where(one, sc[:, 0] / np.float32(1 << (bits - conv_bits)), np.nan).astype(np.float32)
    q, d, kept = fit_rows(ref, bits, row_step)
    stats.rows_kept += int(kept.sum())
    stats.rows_refit += int((~kept).sum())
    stats.add(proj, amx_dequantize(q, d, bits), ref)
    return q, d


def write_amx_experts(conv: ConvertedDir, root: Path, method: str, n_parts: int, progress=None) -> dict:
    """Write OUT/kt-experts/layer-LLLL.safetensors for an AMX method; returns the error report (ErrorStats)."""
    geo = conv.geometry
    bits = AMX_METHOD_BITS[method]
    geoms = check_amx(geo.hidden, geo.intermediate, n_parts, bits)
    part = geo.intermediate // n_parts
    stats = ErrorStats()
    out_dir = root / KT_EXPERT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    for layer in geo.moe_layers:
        specs = []
        for e in range(geo.n_experts):
            for p in PROJECTIONS:
                for m in range(n_parts):
                    g = geoms[p]
                    specs.append(TensorSpec(amx_tensor_name(layer, p, e, m, "weight"), "U8", (g.weight_nbytes,)))
                    specs.append(TensorSpec(amx_tensor_name(layer, p, e, m, "scale"), "F32", (g.n,)))
        meta = {"kt.method": method, "kt.numa_parts": str(n_parts), "producer": "ktconvert export --for sglang-kt"}
        with AlignedWriter(out_dir / f"layer-{layer:04d}.safetensors", specs, meta) as w:
            for e in range(geo.n_experts):
                for p in PROJECTIONS:
                    codes, scales = source_codes(conv, layer, e, p)
                    for m in range(n_parts):
                        span = slice(m * part, (m + 1) * part)
                        rows, cols = (slice(None), span) if p == "down" else (span, slice(None))
                        try:
                            q, d = amx_part(codes, scales, geo.bits, bits, rows, cols, stats, p)
                            w.write(amx_tensor_name(layer, p, e, m, "weight"), pack_amx(q, geoms[p]))
                        except LayoutError as err:
                            raise KtExportError(f"layer {layer} expert {e} {p} part {m}: {err}") from None
                        w.write(amx_tensor_name(layer, p, e, m, "scale"), d)
                        if progress is not None:
                            progress(geoms[p].weight_nbytes + geoms[p].scale_nbytes)
            w.commit()
    return stats.to_json()


def amx_total_bytes(conv: ConvertedDir, method: str, n_parts: int) -> int:
    geo = conv.geometry
    geoms = check_amx(geo.hidden, geo.intermediate, n_parts, AMX_METHOD_BITS[method])
    per_expert = sum(g.weight_nbytes + g.scale_nbytes for g in geoms.values()) * n_parts
    return len(geo.moe_layers) * geo.n_experts * per_expert


def write_plan_record(root: Path, record: dict) -> None:
    (root / "ktconvert-export.json").write_text(json.dumps(record, indent=2) + "\n")
