"""Conversion orchestration: plan -> (resume) -> stream every file -> copy config/tokenizer -> manifest.json last.

Memory: routed experts are read, quantized and written one expert at a time (a bounded window of `workers + 1`
experts in flight), dense tensors one tensor at a time, so peak memory is about one expert plus the largest
non-expert tensor, independent of the number of layers. Threads share the work: numpy and the reader release the
GIL in their large operations.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from ktlayouts.constants import FORMAT_VERSION, METHOD_TO_LAYOUT, ZERO_POINT
from ktlayouts.converted_dir import MANIFEST_NAME, PROJECTIONS, ExpertGeometry, expert_tensor
from ktlayouts.cpu_expert import pack_expert_codes, pack_expert_matrix
from tqdm import tqdm

from ktconvert.convert_plan import ConvertError, ConvertPlan, FileJob, make_plan
from ktconvert.gpu import GPU_OPTION_FIELDS, dense_encoder_for
from ktconvert.manifest import copy_side_files, write_manifest
from ktconvert.progress import Journal, prepare_output
from ktconvert.sources import open_source
from ktconvert.writer import AlignedWriter

TEST_KILL_ENV = "KTCONVERT_TEST_KILL_AT"   # "event:n": SIGKILL self at the n-th event (dense|expert|commit|file); tests only


@dataclass(frozen=True)
class ConvertOptions:
    method: str = "int4-amx"
    group_size: int = 128
    numa_nodes: int = 1
    gpu_method: str = "bf16"       # encoder of non-expert tensors: bf16 | auto | gptq-int4 | rtn-int4 | rtn-int8
    gpu_group_size: int = 128      # GPU-layer options (ktconvert.gpu.encoder.GpuLayerOptions)
    gpu_format: str = "marlin"
    calib: str | None = None
    quantize_head: bool = False
    gpu_act_order: bool = False
    workers: int = 2

    def __post_init__(self):
        if self.method not in METHOD_TO_LAYOUT:
            raise ConvertError(f"--method {self.method!r}: choose one of {', '.join(METHOD_TO_LAYOUT)}")
        if self.numa_nodes < 1:
            raise ConvertError(f"--numa-nodes must be >= 1, got {self.numa_nodes}")
        if self.workers < 1:
            raise ConvertError(f"--workers must be >= 1, got {self.workers}")


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


def _shard_matrices(w: dict[str, np.ndarray], geo: ExpertGeometry, shard: int) -> dict[str, np.ndarray]:
    """One expert's gate/up (I, H) and down (H, I) -> the shard's slices, zero-padded to the unit boundary."""
    i0, i1 = geo.shard_plan.shard_range(shard)
    take = max(0, min(i1, geo.intermediate) - i0)
    out = {}
    for p in PROJECTIONS:
        if take == i1 - i0:      # no padding rows in this shard: a view, pack_expert_matrix copies anyway
            out[p] = w[p][:, i0:i1] if p == "down" else w[p][i0:i1]
            continue
        if p == "down":
            m = np.zeros((geo.hidden, i1 - i0), np.float32)
            m[:, :take] = w[p][:, i0:i0 + take]
        else:
            m = np.zeros((i1 - i0, geo.hidden), np.float32)
            m[:take] = w[p][i0:i0 + take]
        out[p] = m
    return out


def _pad_to(a: np.ndarray, shape: tuple, fill) -> np.ndarray:
    out = np.full(shape, fill, dtype=a.dtype)
    out[: a.shape[0], : a.shape[1]] = a
    return out


def _is_exact_int8(src, names: dict[str, str], geo: ExpertGeometry) -> bool:
    """Whether these source tensors are blocks that are exactly int8 group-32 codes (GGUF Q8_0): dtypes only."""
    return (geo.bits == 8 and geo.group_size == 32 and hasattr(src, "read_int8_groups")
            and all(src.info(n).dtype == "Q8_0" for n in names.values()))


def _exact_int8(src, names: dict[str, str], geo: ExpertGeometry) -> dict | None:
    """{proj: (codes, scales)} taken over from the source when _is_exact_int8, else None."""
    if not _is_exact_int8(src, names, geo):
        return None
    exact = {p: src.read_int8_groups(n) for p, n in names.items()}
    return exact if all(v is not None for v in exact.values()) else None


def _shard_codes(exact: dict, geo: ExpertGeometry, shard: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The shard's slice of exact int8 codes/scales, padded like _shard_matrices (code ZERO, scale 0)."""
    i0, i1 = geo.shard_plan.shard_range(shard)
    take, z, g = max(0, min(i1, geo.intermediate) - i0), ZERO_POINT[8], geo.group_size
    out = {}
    for p, (c, s) in exact.items():
        if p == "down":
            out[p] = (_pad_to(c[:, i0:i0 + take], (geo.hidden, i1 - i0), z),
                      _pad_to(s[:, i0 // g:(i0 + take) // g], (geo.hidden, (i1 - i0) // g), 0.0))
        else:
            out[p] = (_pad_to(c[i0:i0 + take], (i1 - i0, geo.hidden), z),
                      _pad_to(s[i0:i0 + take], (i1 - i0, s.shape[1]), 0.0))
    return out


def _pack_expert(src, adapter, geo: ExpertGeometry, layer: int, e: int,
                 shards: list[int]) -> list[dict[str, np.ndarray]]:
    """Read expert e of `layer` and pack it for the given shards -> per shard {tensor name: array}."""
    names = {p: adapter.expert_tensor_name(layer, e, p) for p in PROJECTIONS}
    exact = _exact_int8(src, names, geo)
    w = None if exact else {p: src.read(n).numpy() for p, n in names.items()}
    per_shard = []
    for s in shards:
        mats = _shard_codes(exact, geo, s) if exact else _shard_matrices(w, geo, s)
        packed = {}
        for p in PROJECTIONS:
            geom = geo.matrix_geometry(p, s)
            qweight, scales = pack_expert_codes(*mats[p], geom) if exact else pack_expert_matrix(mats[p], geom)
            packed[expert_tensor(p, "qweight")] = qweight
            if scales is not None:
                packed[expert_tensor(p, "scales")] = scales
        per_shard.append(packed)
    return per_shard


class Converter:
    def __init__(self, src, out_dir: Path, opts: ConvertOptions, plan: ConvertPlan, journal: Journal, encoder, bar,
                 kill):
        self.src, self.out_dir, self.opts, self.plan, self.journal = src, out_dir, opts, plan, journal
        self.encoder, self.bar, self.kill = encoder, bar, kill

    def _commit(self, writer: AlignedWriter, rel: str) -> None:
        size, sha = writer.commit()
        self.kill("commit")
        self.journal.record(rel, size, sha)
        self.kill("file")

    def write_dense(self, job: FileJob) -> None:
        with AlignedWriter(self.out_dir / job.rel, job.specs, job.metadata) as w:
            for name, role in job.sources:
                tensor = self.src.read(name).numpy()
                for out_name, arr in self.encoder.encode(name, tensor, role).items():
                    w.write(out_name, arr)
                self.bar.update(self.src.info(name).nbytes)
                self.kill("dense")
            self._commit(w, job.rel)

    def write_experts(self, jobs: list[FileJob], pool: ThreadPoolExecutor, group_nbytes: int) -> None:
        """Write the expert shard files `jobs` of one layer (on resume: only the shards not done yet);
        group_nbytes: source bytes of the whole layer's experts (progress)."""
        geo, layer = self.plan.geometry, jobs[0].layer
        shards = [job.shard for job in jobs]
        adapter = self.src.arch
        writers = []
        try:
            for job in jobs:
                writers.append(AlignedWriter(self.out_dir / job.rel, job.specs, job.metadata))
            per_expert = group_nbytes // geo.n_experts
            window: deque = deque()
            for e in range(geo.n_experts):
                window.append((e, pool.submit(_pack_expert, self.src, adapter, geo, layer, e, shards)))
                if len(window) > self.opts.workers:
                    self._drain_one(window, writers, per_expert)
            while window:
                self._drain_one(window, writers, per_expert)
            for w, job in zip(writers, jobs):
                self._commit(w, job.rel)
        except BaseException:
            for w in writers:
                w.abort()
            raise

    def _drain_one(self, window, writers, per_expert) -> None:
        e, fut = window.popleft()
        for w, packed in zip(writers, fut.result()):
            for name, arr in packed.items():
                w.write(name, arr, index=e)
        self.bar.update(per_expert)
        self.kill("expert")


def skipped_parts(src, names: list[str]) -> dict[str, int]:
    """{what they are: how many} of the skipped tensors whose role says (MTP layers, a vision tower)."""
    out: dict[str, int] = {}
    for name in names:
        reason = src.arch.classify(name).reason
        if reason:
            out[reason] = out.get(reason, 0) + 1
    return out


def conversion_params(src, opts: ConvertOptions) -> dict:
    """What makes two runs produce the same output (the resume journal compares these)."""
    shard_files = sorted({(i.file.name, i.file.stat().st_size) for i in map(src.info, src.tensor_names())})
    return {"format_version": FORMAT_VERSION, "source": str(Path(src.path).resolve()),
            "source_files": [list(x) for x in shard_files], "method": opts.method,
            "group_size": opts.group_size, "numa_nodes": opts.numa_nodes, "gpu_method": opts.gpu_method,
            **({} if opts.gpu_method == "bf16" else
               {k: getattr(opts, k) for k in ("gpu_group_size", "gpu_format", "quantize_head", "gpu_act_order")})}


def convert(src_path: str | Path, out_dir: str | Path, opts: ConvertOptions, resume: bool = False,
            force: bool = False, show_progress: bool = True) -> Path:
    """Convert the checkpoint at src_path into out_dir; returns the path of the written manifest.json."""
    out_dir = Path(out_dir)
    kill = _KillHook()
    with open_source(src_path) as src:
        encoder = dense_encoder_for(src, **{k: getattr(opts, k) for k in GPU_OPTION_FIELDS})
        opts = replace(opts, gpu_method=encoder.name)     # "auto" resolved (the log says which)
        plan = make_plan(src, src.arch, opts.method, opts.group_size, opts.numa_nodes, encoder)
        params = conversion_params(src, opts)
        journal = prepare_output(out_dir, params, resume=resume, force=force)
        done = sum(j.source_nbytes for g in plan.jobs for j in g if all(journal.is_done(x.rel) for x in g))
        bar = tqdm(total=plan.source_nbytes, initial=done, unit="B", unit_scale=True, unit_divisor=1000,
                   desc="converting", disable=not show_progress, dynamic_ncols=True)
        layers = src.arch.moe_layers()
        if layers and _is_exact_int8(src, {p: src.arch.expert_tensor_name(layers[0], 0, p) for p in PROJECTIONS},
                                     plan.geometry):
            tqdm.write("experts: GGUF Q8_0 blocks taken over exactly as int8 group-32 codes and scales "
                       "(no float round trip)", file=sys.stderr)
        for reason, n in skipped_parts(src, plan.skipped).items():
            tqdm.write(f"skipped {n} tensors: {reason}", file=sys.stderr)
        conv = Converter(src, out_dir, opts, plan, journal, encoder, bar, kill)
        try:
            with ThreadPoolExecutor(max_workers=opts.workers, thread_name_prefix="ktconvert") as pool:
                for group in plan.jobs:
                    if all(journal.is_done(j.rel) for j in group):
                        continue
                    for job in group:
                        if job.kind != "expert" and not journal.is_done(job.rel):
                            conv.write_dense(job)
                    experts = [j for j in group if j.kind == "expert"]
                    todo = [j for j in experts if not journal.is_done(j.rel)]
                    if todo:
                        conv.write_experts(todo, pool, sum(j.source_nbytes for j in experts))
                    src.close()   # unmap the shards read so far: mapped pages would count as RSS for the whole run
            side = copy_side_files(src, out_dir, journal, encoder)
            manifest = write_manifest(src, out_dir, opts, plan, journal, side)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise ConvertError(f"disk full while writing into {out_dir} ({os.strerror(e.errno)}"
                                   f"{': ' + e.filename if e.filename else ''}); the output is incomplete (no "
                                   f"{MANIFEST_NAME}); free space and rerun with --resume") from None
            raise
        finally:
            bar.close()
        journal.path.unlink(missing_ok=True)
    return manifest
