"""Conversion orchestration: plan -> (resume) -> stream every file -> copy config/tokenizer -> manifest.json last.

Memory: routed experts are read, quantized and written one expert at a time (a bounded window of `workers + 1`
experts in flight), dense tensors one tensor at a time, so peak memory is about one expert plus the largest
non-expert tensor, independent of the number of layers. Threads share the work: numpy and the reader release the
GIL in their large operations.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from ktlayouts.constants import (
    DEFAULT_GPU_GROUP_SIZE,
    DEFAULT_GROUP_SIZE,
    DEFAULT_SCALE_DTYPE,
    FORMAT_VERSION,
    GROUP_PER_ROW,
    METHOD_TO_LAYOUT,
    SCALE_DTYPES,
    default_group_size,
)
from ktlayouts.converted_dir import MANIFEST_NAME, PROJECTIONS, ExpertGeometry, expert_tensor
from ktlayouts.cpu_expert import pack_expert_codes, unpack_codes, unpack_expert_matrix, unpack_scales
from ktlayouts.cpu_expert import pack_expert_matrix as reference_pack
from ktlayouts.expert_formats import (
    DEFAULT_METHOD,
    UNDECLARED_SCALE_DTYPE,
    expert_format_of_method,
    expert_formats,
    scale_encoding,
)
from ktlayouts.expert_shards import shard_codes, shard_matrices
from tqdm import tqdm

from ktconvert.convert_plan import ConvertError, ConvertPlan, FileJob, make_plan
from ktconvert.exact_paths import PathLog, choose_method, expert_codes, quant_format, relative_error
from ktconvert.gpu import GPU_OPTION_FIELDS, dense_encoder_for
from ktconvert.hot_placement import load_checked_profile, placement_params, write_placement
from ktconvert.manifest import copy_side_files, write_manifest
from ktconvert.progress import Journal, prepare_output
from ktconvert.quantizers import make_expert_quantizer
from ktconvert.read_buffer import ReadBuffer, floats_for
from ktconvert.sources import open_source
from ktconvert.time_shares import TimeShares
from ktconvert.writer import AlignedWriter

log = logging.getLogger("ktconvert")
TEST_KILL_ENV = "KTCONVERT_TEST_KILL_AT"   # "event:n": SIGKILL self at the n-th event (dense|expert|commit|file); tests only


@dataclass(frozen=True)
class ConvertOptions:
    method: str = DEFAULT_METHOD   # or "auto": the exact target of an already-quantized source (exact_paths)
    group_size: int | None = DEFAULT_GROUP_SIZE   # None: the default, or the source's group with method "auto"
    numa_nodes: int = 1
    gpu_method: str = "bf16"       # encoder of non-expert tensors: bf16 | auto | gptq-int4 | rtn-int4 | rtn-int8
    gpu_group_size: int = DEFAULT_GPU_GROUP_SIZE   # GPU-layer options (ktconvert.gpu.encoder.GpuLayerOptions)
    gpu_format: str = "marlin"
    calib: str | None = None
    quantize_head: bool = False
    gpu_act_order: bool = False
    calib_tokens: int = 2048       # calibration tokens (GPTQ Hessians, importance) for GPU layers and experts
    gpu_method_for: tuple = ()     # --gpu-method-for (glob, method) rules: per-Linear methods (ktconvert.gpu.mix)
    gpu_mix_budget: float | None = None   # measured int8 upgrades (ktconvert.gpu.sensitivity); None: auto's default
    gpu_mix_method: str = "gptq-int8"
    gpu_mix_chosen: tuple = ()     # the Linears that rule upgraded (set by conversion_parts; in the manifest)
    expert_quantizer: str = "auto"  # auto | gptq | search | rtn (ktconvert.quantizers.experts)
    expert_gptq_min_tokens: int = 0   # routed tokens an expert needs for GPTQ (0: K/2 of the matrix)
    scale_dtype: str = DEFAULT_SCALE_DTYPE   # expert scales: f16 (layout version 2), bf16, f32 (version 1), or
                                             # sub6 (version 3: two-level, int4 group 32)
    workers: int = 2
    bf16_scales: bool = False      # expert scales rounded to bf16 before quantizing (exact in bf16-scale formats)
    hot_experts: object = None     # ktrun.experts.placement.HotExpertOptions: write gpu_experts.json
    keep_mtp: bool = True          # write the checkpoint's multi-token-prediction layers (manifest kinds mtp_*)

    def __post_init__(self):
        if self.method not in METHOD_TO_LAYOUT and self.method != "auto":
            raise ConvertError(f"--method {self.method!r}: choose one of auto, {', '.join(METHOD_TO_LAYOUT)}")
        if self.numa_nodes < 1:
            raise ConvertError(f"--numa-nodes must be >= 1, got {self.numa_nodes}")
        if self.workers < 1:
            raise ConvertError(f"--workers must be >= 1, got {self.workers}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ConvertError(f"--scale-dtype {self.scale_dtype!r}: choose one of {', '.join(SCALE_DTYPES)}")
        fmt = None if self.method == "auto" else expert_format_of_method(self.method)
        if self.bf16_scales and fmt is not None and not fmt.quantized:
            raise ConvertError(f"--bf16-scales rounds the scales of quantized experts; --method {self.method} has none")
        enc = scale_encoding(self.scale_dtype)
        wrong_bits = fmt is not None and fmt.bits not in enc.weight_bits()
        if (enc.bits is not None and wrong_bits) or (not enc.elementwise and self.bf16_scales):
            fmts = [f for f in expert_formats() if f.bits in enc.weight_bits()]
            raise ConvertError(
                f"--scale-dtype {enc.name} ({enc.what}) is an {' or '.join(f.name for f in fmts)} layout"
                f"{'' if enc.elementwise else ' without bf16 scales'}: use it with --method "
                f"{' or '.join(f.method for f in fmts)}{'' if enc.elementwise else ' and without --bf16-scales'} "
                f"(got --method {self.method}{' --bf16-scales' if self.bf16_scales else ''})")


class _KillHook:
    """Test hook: kill this process (SIGKILL, no cleanup) at a chosen point, to prove resume."""

    def __init__(self):
        spec = os.environ.get(TEST_KILL_ENV, "")
        self.event, _, n = spec.partition(":")
        self.left = int(n) if n else 0

    def __call__(self, event: str) -> None:
        if self.left and event == self.event:
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGKILL)


def pack_expert_matrix(w: np.ndarray, geom, quantizer=None, proj: str = "", stats=None,
                       k_range: tuple[int, int] = (0, 0), bf16_scales: bool = False
                       ) -> tuple[np.ndarray, np.ndarray | None]:
    """One expert matrix (N, K) -> (qweight, scales) with the conversion's quantizer (None or mode rtn: the
    layout's reference rule, ktlayouts.cpu_expert.pack_expert_matrix). bf16_scales: scales on the bf16 grid."""
    if quantizer is None or quantizer.mode == "rtn" or not geom.format.quantized:
        return reference_pack(w, geom, bf16_scales)
    return quantizer.pack(proj, w, geom, stats, k_range, bf16_scales=bf16_scales)


def _pack_expert(src, adapter, geo: ExpertGeometry, layer: int, e: int, shards: list[int],
                 paths: PathLog | None = None, bf16_scales: bool = False, quantizer=None, scratch_floats: int = 0,
                 shares: TimeShares | None = None) -> list[dict[str, np.ndarray]]:
    """Read expert e of `layer` and pack it for the given shards -> per shard {tensor name: array}. Codes and
    scales of an already-quantized source are taken over where they fit the layout (ktconvert.exact_paths).
    bf16_scales: quantize against bf16-rounded scales (a source's own scales are then not taken over).
    quantizer: a ktconvert.quantizers.experts.ExpertQuantizer (None or mode rtn: the layout's reference rule).
    scratch_floats: the size of the thread's read buffer (_read_reused). shares: where its read and quantize
    seconds are added (the progress bar's time shares)."""
    shares = shares if shares is not None else TimeShares()
    names = {p: adapter.expert_tensor_name(layer, e, p) for p in PROJECTIONS}
    exact, why, what = expert_codes(src, names, geo.bits, geo.group_size, geo.scale_dtype)
    if bf16_scales and exact:
        exact, why = None, "--bf16-scales re-fits the scales"
    with shares.timing("read"):
        w = None if exact else _read_reused(src, names, scratch_floats)
    t_quantize = time.perf_counter()
    custom = quantizer is not None and quantizer.mode != "rtn" and not exact and geo.format.quantized
    stats = quantizer.expert_stats(layer, e, w) if custom else None
    if custom and geo.numa_nodes > 1 and geo.group_size != GROUP_PER_ROW and all(
            k % geo.group_size == 0 for k in (geo.hidden, geo.intermediate)):
        # a calibrated quantizer (GPTQ feeds errors along K) quantizes the whole matrix once and the shards take its
        # codes, so files for any NUMA count hold the 1-node conversion's weights (per-row scales stay per shard)
        codes, custom = _quantize_whole(w, geo, quantizer, stats, bf16_scales), False
    else:
        codes = exact
    per_shard = []
    for s in shards:
        mats = shard_codes(codes, geo.shard_plan, s) if codes else shard_matrices(w, geo.shard_plan, s)
        packed = {}
        for p in PROJECTIONS:
            geom = geo.matrix_geometry(p, s)
            qweight, scales = pack_expert_codes(*mats[p], geom) if codes else \
                pack_expert_matrix(mats[p], geom, quantizer if custom else None, p, stats,
                                   geo.shard_plan.shard_range(s), bf16_scales)
            packed[expert_tensor(p, "qweight")] = qweight
            if scales is not None:
                packed[expert_tensor(p, "scales")] = scales
        per_shard.append(packed)
    shares.add("quantize", time.perf_counter() - t_quantize)
    if paths is not None and what:                 # a quantized source: say which path, and what it cost
        for p, n in names.items():
            if exact:
                paths.exact("experts", layer, n, what)
            else:
                paths.requantized("experts", layer, n, what, why, _shards_error(w[p], p, per_shard, shards, geo))
    return per_shard


_SCRATCH = threading.local()     # per thread: .reader, the ReadBuffer the tensors it reads are decoded into
SCRATCH_MAX_FLOATS = 1 << 27     # tensors above 512 MB of float32 (a large vocabulary's embedding) read as new arrays


def release_read_buffer() -> None:
    """Drop this thread's read buffer (_read_reused), e.g. after a sample read on a thread that reads no more."""
    _SCRATCH.reader = None


def _scratch_floats(src, names) -> int:
    """Floats of the buffer that `names` (read together) are decoded into side by side (read_buffer.floats_for, at
    most SCRATCH_MAX_FLOATS)."""
    return floats_for(src, list(names), SCRATCH_MAX_FLOATS)


def scratch_size(src, plan: ConvertPlan) -> int:
    """The buffer size every reading thread will need for this plan (the largest dense tensor or expert read
    through _read_reused): allocated at that size at once, it is never regrown (each regrowth was new memory)."""
    sizes = [_scratch_floats(src, [n]) for jobs in plan.jobs for j in jobs if j.kind != "expert" for n, _ in j.sources]
    if plan.geometry.n_experts and any(j.kind == "expert" for jobs in plan.jobs for j in jobs):
        layer = next(j.layer for jobs in plan.jobs for j in jobs if j.kind == "expert")
        sizes.append(_scratch_floats(src, [src.arch.expert_tensor_name(layer, 0, p) for p in PROJECTIONS]))
    return max(sizes, default=0)


def _read_reused(src, names: dict[str, str], reserve: int = 0) -> dict[str, np.ndarray]:
    """{key: tensor name} -> {key: float32 numpy}, decoded side by side into this thread's one reused buffer where
    the source can (ktconvert.read_buffer), else read as new arrays. One buffer per thread (the largest dense tensor
    or an expert's three matrices) keeps the footprint at what one tensor needs. Valid until this thread reads
    again: the caller (a pack worker's expert, a dense tensor's encode) keeps nothing of it.
    reserve: floats to allocate at least when the buffer is (re)made (scratch_size of the conversion)."""
    reader = getattr(_SCRATCH, "reader", None)
    if reader is None:
        reader = _SCRATCH.reader = ReadBuffer(SCRATCH_MAX_FLOATS)
    return {k: t.numpy() for k, t in zip(names, reader.read(src, list(names.values()), reserve))}


def _quantize_whole(w: dict[str, np.ndarray], geo: ExpertGeometry, quantizer, stats, bf16_scales: bool
                    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{proj: (codes (N, K) uint8, scales (N, K / G) float32)} of one expert quantized as a 1-shard conversion."""
    whole = replace(geo, numa_nodes=1)
    mats = shard_matrices(w, whole.shard_plan, 0)
    out = {}
    for p in PROJECTIONS:
        geom = whole.matrix_geometry(p, 0)
        qweight, scales = pack_expert_matrix(mats[p], geom, quantizer, p, stats, whole.shard_plan.shard_range(0),
                                             bf16_scales)
        n, k = w[p].shape
        out[p] = (unpack_codes(qweight, geom)[:n, :k], unpack_scales(scales, geom)[:n, : k // geo.group_size])
    return out


def _shards_error(w: np.ndarray, proj: str, per_shard: list[dict], shards: list[int], geo: ExpertGeometry) -> float:
    """||W_out - W|| / ||W|| of one projection over the shards packed (padding is zero on both sides)."""
    num = den = 0.0
    for s, packed in zip(shards, per_shard):
        ref = shard_matrices({proj: w}, geo.shard_plan, s)[proj]
        out = unpack_expert_matrix(packed[expert_tensor(proj, "qweight")], packed.get(expert_tensor(proj, "scales")),
                                   geo.matrix_geometry(proj, s))
        num += float(np.sum((out.astype(np.float64) - ref) ** 2))
        den += float(np.sum(np.asarray(ref, dtype=np.float64) ** 2))
    return (num / den) ** 0.5 if den else (0.0 if num == 0 else float("inf"))


class Converter:
    def __init__(self, src, out_dir: Path, opts: ConvertOptions, plan: ConvertPlan, journal: Journal, encoder, bar,
                 kill, quantizer=None, scratch_floats: int = 0):
        self.src, self.out_dir, self.opts, self.plan, self.journal = src, out_dir, opts, plan, journal
        self.scratch_floats = scratch_floats        # the reading threads' buffer size (scratch_size)
        self.encoder, self.bar, self.kill, self.quantizer = encoder, bar, kill, quantizer
        self.paths = PathLog()          # which tensors of an already-quantized source took which path
        self.shares = TimeShares()      # read / calibrate / quantize / write seconds, shown on the progress bar

    def _commit(self, writer: AlignedWriter, rel: str) -> None:
        with self.shares.timing("write"):
            size, sha = writer.commit()
        self.kill("commit")
        self.journal.record(rel, size, sha)
        self.kill("file")

    def _encode_dense(self, name: str, role) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
        """-> (the source tensor where _dense_path needs it (a quantized source), else None; the encoded arrays).
        Without calibration the tensor is read into this thread's reused buffer (_read_reused), and an encoded
        array that is the tensor's memory (a float32 norm written as read) is copied out of it."""
        keep = quant_format(self.src, name) is not None or getattr(self.encoder, "calibrated", False)
        with self.shares.timing("read"):
            tensor = self.src.read(name).numpy() if keep else \
                _read_reused(self.src, {name: name}, self.scratch_floats)[name]
        # a calibrated encoder runs the calibration forward inside encode: its time counts as calibration
        with self.shares.timing("calibrate" if getattr(self.encoder, "calibrated", False) else "quantize"):
            out = self.encoder.encode(name, tensor, role)
        if keep:
            return tensor, out
        return None, {k: v.copy() if np.may_share_memory(v, tensor) else v for k, v in out.items()}

    def write_dense(self, job: FileJob, pool: ThreadPoolExecutor | None = None) -> None:
        """One dense file. Without calibration every tensor encodes independently: up to `workers` of them on the
        pool while this thread writes them in order (the same bytes; a layer's attention was a third of an rtn
        conversion's wall time on one thread). A calibrating encoder runs on this thread: its driver runs layers."""
        parallel = pool is not None and not getattr(self.encoder, "calibrated", False)
        window: deque = deque()
        with AlignedWriter(self.out_dir / job.rel, job.specs, job.metadata) as w:
            def drain():
                name, role, fut = window.popleft()
                tensor, out = fut.result()
                self._dense_path(job, name, role, tensor, out)
                with self.shares.timing("write"):
                    for out_name, arr in out.items():
                        w.write(out_name, arr)
                self._progress(self.src.info(name).nbytes)
                self.kill("dense")
            try:
                for name, role in job.sources:
                    if parallel:
                        fut = pool.submit(self._encode_dense, name, role)
                    else:                                      # encoded here and now, written at once
                        fut = Future()
                        fut.set_result(self._encode_dense(name, role))
                    window.append((name, role, fut))
                    if len(window) > (self.opts.workers if parallel else 0):
                        drain()
                while window:
                    drain()
            except BaseException:
                for _, _, fut in window:
                    fut.cancel()
                raise
            self._commit(w, job.rel)

    def _dense_path(self, job: FileJob, name: str, role, tensor: np.ndarray | None, out: dict) -> None:
        """Log the path of a quantized source Linear: codes taken over (the encoder says), or the error that its
        encoding introduced against the source's own dequantization."""
        fmt = quant_format(self.src, name)
        if fmt is None:
            return
        path = getattr(self.encoder, "path_of", lambda _n: None)(name)
        if path is not None and path[0]:
            self.paths.exact("GPU layers", role.layer, name, fmt.label)
            return
        from ktlayouts.bf16 import bf16_bits_to_f32
        from ktlayouts.gpu_formats import dequantize_named, is_gpu_layout

        layout = next((job.layouts[o] for o in out), "")
        got = (dequantize_named(layout, out, name) if is_gpu_layout(layout) else
               bf16_bits_to_f32(out[name]) if out[name].dtype == np.uint16 else out[name])
        why = path[1] if path is not None else f"written as {layout}"
        self.paths.requantized("GPU layers", role.layer, name, fmt.label, why, relative_error(got, tensor))

    def write_experts(self, jobs: list[FileJob], pool: ThreadPoolExecutor, group_nbytes: int) -> None:
        """Write the expert shard files `jobs` of one layer (on resume: only the shards not done yet);
        group_nbytes: source bytes of the whole layer's experts (progress)."""
        geo, layer = self.plan.geometry, jobs[0].layer
        shards = [job.shard for job in jobs]
        adapter = self.src.arch
        # an MTP layer has no calibration inputs (the driver runs the main layers): the layout's reference rule
        quantizer = None if jobs[0].mtp else self.quantizer
        writers = []
        try:
            for job in jobs:
                writers.append(AlignedWriter(self.out_dir / job.rel, job.specs, job.metadata))
            per_expert = group_nbytes // geo.n_experts
            if quantizer is not None:
                with self.shares.timing("calibrate"):   # this layer's forward, on this (the main) thread or
                    quantizer.begin_layer(layer)        # the wait for the prefetch thread's
            window: deque = deque()
            for e in range(geo.n_experts):
                window.append((e, pool.submit(_pack_expert, self.src, adapter, geo, layer, e, shards, self.paths,
                                              self.opts.bf16_scales, quantizer, self.scratch_floats, self.shares)))
                if len(window) > self.opts.workers:
                    self._drain_one(window, writers, per_expert)
            while window:
                self._drain_one(window, writers, per_expert)
            if quantizer is not None:
                quantizer.layer_done(layer)
            for w, job in zip(writers, jobs):
                self._commit(w, job.rel)
            line = self.paths.layer_line("experts", layer, self.target())
            if line:
                log.info(line)
        except BaseException:
            for w in writers:
                w.abort()
            raise

    def target(self) -> str:
        g = self.plan.geometry
        return f"{g.method} group {g.group_size}" if g.format.quantized else g.method

    def _drain_one(self, window, writers, per_expert) -> None:
        e, fut = window.popleft()
        packed_shards = fut.result()
        with self.shares.timing("write"):
            for w, packed in zip(writers, packed_shards):
                for name, arr in packed.items():
                    w.write(name, arr, index=e)
        self._progress(per_expert)
        self.kill("expert")

    def _progress(self, nbytes: int) -> None:
        """Advance the bar by nbytes of source, with where the time went so far (TimeShares)."""
        self.bar.set_postfix_str(self.shares.postfix(), refresh=False)
        self.bar.update(nbytes)


def skipped_parts(src, names: list[str]) -> dict[str, int]:
    """{what they are: how many} of the skipped tensors whose role says (MTP layers, a vision tower)."""
    out: dict[str, int] = {}
    for name in names:
        reason = src.arch.classify(name).reason
        if reason:
            out[reason] = out.get(reason, 0) + 1
    return out


def resolve_method(src, opts: ConvertOptions) -> ConvertOptions:
    """--method auto -> the exact target of the source's routed experts (or int4-amx); a group size left open
    (None) -> the chosen one (auto) or DEFAULT_GROUP_SIZE. The log says which and why."""
    if opts.method != "auto":       # two-level scales sit on groups of 32: their default group
        return opts if opts.group_size is not None else replace(opts, group_size=default_group_size(opts.scale_dtype))
    method, group, why = choose_method(src)
    group = group if opts.group_size is None else opts.group_size
    log.info("--method auto: %s --group-size %d (%s)", method, group, why)
    return replace(opts, method=method, group_size=group)


def conversion_params(src, opts: ConvertOptions) -> dict:
    """What makes two runs produce the same output (the resume journal compares these)."""
    shard_files = sorted({(i.file.name, i.file.stat().st_size) for i in map(src.info, src.tensor_names())})
    return {"format_version": FORMAT_VERSION, "source": str(Path(src.path).resolve()),
            "source_files": [list(x) for x in shard_files], "method": opts.method,
            "group_size": opts.group_size, "numa_nodes": opts.numa_nodes, "gpu_method": opts.gpu_method,
            **({} if opts.scale_dtype == UNDECLARED_SCALE_DTYPE else {"scale_dtype": opts.scale_dtype}),
            **({} if opts.gpu_method == "bf16" else
               {k: getattr(opts, k) for k in ("gpu_group_size", "gpu_format", "quantize_head", "gpu_act_order")}),
            **({} if opts.expert_quantizer in ("rtn", "none") else
               {k: getattr(opts, k) for k in ("expert_quantizer", "expert_gptq_min_tokens", "calib", "calib_tokens")}),
            **({"gpu_method_for": [list(r) for r in opts.gpu_method_for]} if opts.gpu_method_for else {}),
            **({"gpu_mix_budget": opts.gpu_mix_budget, "gpu_mix_method": opts.gpu_mix_method, "calib": opts.calib,
                "calib_tokens": opts.calib_tokens} if opts.gpu_mix_budget else {}),
            **({"bf16_scales": True} if opts.bf16_scales else {}),
            **({"keep_mtp": True} if opts.keep_mtp and src.arch.mtp_layers(src.tensor_names()) else {}),
            **({} if opts.hot_experts is None else {"hot_experts": placement_params(opts.hot_experts)})}


def conversion_parts(src, opts: ConvertOptions, measure: bool = True
                     ) -> tuple[ConvertOptions, object, object, ConvertPlan]:
    """(options with method / GPU method / expert quantizer resolved, dense encoder, expert quantizer or None,
    plan) of converting `src`: what convert runs and what ktconvert.estimate times. measure: run the measured
    mixed-precision rule's pass now (--gpu-mix-budget; without it, an estimate, the plan has no upgrades)."""
    opts = resolve_method(src, opts)
    encoder = dense_encoder_for(src, **{k: getattr(opts, k) for k in GPU_OPTION_FIELDS})
    if measure and hasattr(encoder, "apply_mix"):
        encoder.apply_mix()
    quantizer = make_expert_quantizer(src, opts, encoder)
    opts = replace(opts, gpu_method=encoder.name,     # "auto" resolved (the log says which)
                   gpu_mix_budget=encoder.opts.mix_budget if getattr(encoder, "mix_applied", False) else 0.0,
                   gpu_mix_chosen=tuple(n for n, _m in getattr(encoder, "mixed_rules", ())),
                   expert_quantizer=quantizer.mode if quantizer else
                   "rtn" if expert_format_of_method(opts.method).quantized else "none")
    plan = make_plan(src, src.arch, opts.method, opts.group_size, opts.numa_nodes, encoder, opts.scale_dtype,
                     opts.keep_mtp)
    return opts, encoder, quantizer, plan


def convert(src_path: str | Path, out_dir: str | Path, opts: ConvertOptions, resume: bool = False,
            force: bool = False, show_progress: bool = True, on_plan=None) -> Path:
    """Convert the checkpoint at src_path into out_dir; returns the path of the written manifest.json.
    on_plan: called as on_plan(src, opts, plan, encoder, quantizer, out_dir) once the conversion is planned, before
    any work (`ktconvert quantize` logs its time estimate there, ktconvert.estimate)."""
    out_dir = Path(out_dir)
    kill = _KillHook()
    with open_source(src_path) as src:
        opts, encoder, quantizer, plan = conversion_parts(src, opts)
        if opts.hot_experts is not None:
            load_checked_profile(opts.hot_experts, src)   # a profile of another model fails before any work
        params = conversion_params(src, opts)
        journal = prepare_output(out_dir, params, resume=resume, force=force)
        done = sum(j.source_nbytes for g in plan.jobs for j in g if all(journal.is_done(x.rel) for x in g))
        bar = tqdm(total=plan.source_nbytes, initial=done, unit="B", unit_scale=True, unit_divisor=1000,
                   desc="converting", disable=not show_progress, dynamic_ncols=True)
        for reason, n in skipped_parts(src, plan.skipped).items():
            tqdm.write(f"skipped {n} tensors: {reason}", file=sys.stderr)
        if plan.mtp_layers:
            tqdm.write(f"multi-token-prediction layer(s) {plan.mtp_layers} kept (--no-keep-mtp drops them)"
                       + (f"; {', '.join(plan.mtp_copies)} equal the main model's and are not written again"
                          if plan.mtp_copies else ""), file=sys.stderr)
        if on_plan is not None:
            on_plan(src, opts, plan, encoder, quantizer, out_dir)
        conv = Converter(src, out_dir, opts, plan, journal, encoder, bar, kill, quantizer, scratch_size(src, plan))
        if quantizer is not None:         # the layers whose experts are still to write (an MTP layer's: never)
            quantizer.prefetch_layers(sorted({j.layer for g in plan.jobs for j in g if j.kind == "expert"
                                              and not j.mtp and not journal.is_done(j.rel)}))
        # With the calibration forward on its own thread, every layer's dense files first: the pack workers encode
        # them while the first MoE layer's forward runs (they waited for it), and the expert layers then follow one
        # another with no dense file between them (a serial stretch at each layer's start, the forward thread idle).
        # The same files either way; a calibrating GPU encoder drives the forward itself, so it keeps layer order.
        dense_first = quantizer is not None and quantizer.prefetching
        try:
            with ThreadPoolExecutor(max_workers=opts.workers, thread_name_prefix="ktconvert") as pool:
                for group in plan.jobs if dense_first else ():
                    for job in group:
                        if job.kind != "expert" and not journal.is_done(job.rel):
                            conv.write_dense(job, pool)
                    src.close()
                for group in plan.jobs:
                    if all(journal.is_done(j.rel) for j in group):
                        continue
                    for job in group:
                        if job.kind != "expert" and not journal.is_done(job.rel):
                            conv.write_dense(job, pool)
                    experts = [j for j in group if j.kind == "expert"]
                    todo = [j for j in experts if not journal.is_done(j.rel)]
                    if todo:
                        conv.write_experts(todo, pool, sum(j.source_nbytes for j in experts))
                    src.close()   # unmap the shards read so far: mapped pages would count as RSS for the whole run
            rules = sorted({m for _g, m in getattr(encoder, "rules", ())} - {encoder.name})
            gpu_target = encoder.name + (f" (some: {', '.join(rules)})" if rules else "")
            for line in conv.paths.summary({"experts": conv.target(), "GPU layers": gpu_target}):
                tqdm.write(f"ktconvert: {line}", file=sys.stderr)
            side = copy_side_files(src, out_dir, journal, encoder)
            placement = None if opts.hot_experts is None else write_placement(
                src, out_dir, opts.hot_experts, plan.geometry, journal)
            manifest = write_manifest(src, out_dir, opts, plan, journal, side, placement)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise ConvertError(f"disk full while writing into {out_dir} ({os.strerror(e.errno)}"
                                   f"{': ' + e.filename if e.filename else ''}); the output is incomplete (no "
                                   f"{MANIFEST_NAME}); free space and rerun with --resume") from None
            raise
        finally:
            bar.close()
            if quantizer is not None:
                quantizer.close()
        journal.path.unlink(missing_ok=True)
    return manifest
