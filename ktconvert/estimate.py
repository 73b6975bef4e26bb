"""The wall time a conversion will take on this machine, from a short timed sample (`ktconvert inspect --method`,
and the first line `ktconvert quantize` logs).

What is timed here, on the checkpoint itself, one thread (CPU seconds of the process, less those of transformers'
imports running beside the samples on a thread of their own; a few for a DeepSeek-V3-sized expert):
  experts  expert 0 of the first MoE layer through the conversion's own read + quantize + pack (_pack_expert), with
           the conversion's expert quantizer; a calibrated one gets synthetic calibration inputs with the routed
           token count an expert gets on average, n = T k / E (T calibration tokens, top-k of E experts). GPTQ runs
           on a matrix whose expert got >= K/2 tokens (ExpertQuantizer), so where that threshold is within reach
           the sample runs twice, just above and just below it, and the two are mixed by the share of experts
           expected above it, n taken as normal with a spread of ROUTING_SPREAD x its mean (the spread measured on
           bench_convert.py's DeepSeek-V3-shaped checkpoint: 660 / 1028 / 1468 min / median / max tokens);
  dense    non-expert tensors of the first MoE layer (its smallest, about DENSE_SAMPLE_BYTES): read and encoded by
           the conversion's encoder (GPTQ GPU layers: quantized with a synthetic Hessian, which costs what a real
           one does), scaled by source bytes, or for GPTQ by its arithmetic;
  forward  (calibrated conversions) a matmul of the calibration forward's shape and dtype, for its FLOP rate (with
           the int4-tile forward, ktconvert.gpu.calib_kernels: torch's float32 one and the tiles' product, and
           quantizing a weight onto the tiles).

The model:
  experts_cpu = experts x the sample;  dense_cpu = non-expert bytes x the sample's seconds per byte (a GPTQ'd
                Linear (N, K): N K^2 + K^3 / 3 at the sample's seconds per unit of that)
  forward     = sum over layers of 2 T (the layer's Linear weights, twice with GPTQ GPU layers: a Hessian pass
                and a quantized pass, + top-k routed experts' weights) + each hit expert's gate / up over the prior's
                sample (PRIOR_SAMPLE tokens), / rate, / FORWARD_MATMUL_SHARE (norms, attention, routing, casts: the
                matmuls were 46% of a profiled DeepSeek-V3-shaped layer; BF16_FORWARD_MATMUL_SHARE, 78%, for the
                expert quantizer's own bf16 forward), + reading each MoE layer's experts at the sample's read rate
                (the bf16 forward: read_bf16 of the sample's expert, timed), + with GPTQ GPU layers their Hessians
                (2 T K^2 each, at the same rate); the int4-tile forward: its matmuls at the tiles' rate instead (the
                rest as at float32), + every weight it tiles (the layers' Linears, the experts hit) at the quantize
                rate
  forward_cpu = forward x (the matmul share x torch's threads + the rest on one); the int4-tile forward: its
                products x the threads + the rest (TILE_FORWARD_REST of the float32 matmul time, the tiling, the
                reads) on one
  write       = output bytes x (write + fsync + sha256 read-back), timed on a sample file beside the output: each
                file's commit is a serial point on the main thread
  mix         = (the measured mixed precision, --gpu-mix-budget, ktconvert.gpu.sensitivity: a pass before the
                conversion, on one thread) forward + dense_cpu + each layer's Linears once more per quantized
                Linear of the layer (2 T p n_quantized / rate / FORWARD_MATMUL_SHARE); not yet timed against a run
  wall        = startup + sample + mix + max(forward, (experts_cpu + dense_cpu + forward_cpu) / (cores x efficiency))
                + write, efficiency PARALLEL_EFFICIENCY (CALIBRATED_PARALLEL_EFFICIENCY for a calibrated one,
                BUSY_CALIBRATED_PARALLEL_EFFICIENCY with the expert quantizer's own forward)
with cores = min(--workers (+1 for the calibration thread), the CPUs this process may use), startup what this
process took until the estimate (imports, and those of the calibration forward), and sample the time the sample
took (quantize times it before it starts). The efficiencies are what bench_convert.py's DeepSeek-V3-shaped
conversions got on 2 cores: rtn's main thread writes the files and numpy holds the GIL between its large operations;
the calibrated default is arithmetic (GPTQ, search, the forward) that keeps the cores busier.
The 64-core question: the experts and dense terms divide by the cores; the forward's matmuls use torch's threads,
the rest of the forward and the writes do not.
"""
from __future__ import annotations

import gc
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# the CPU seconds of the samples, summed, over (wall - serial parts) x cores, measured on 2 cores with 2 workers
# (bench_convert.py's DeepSeek-V3-shaped checkpoint, 2 rounds): the rtn conversion (reads and writes between its
# arithmetic, memory bandwidth shared by the workers) and the calibrated default (GPTQ, search, forward)
PARALLEL_EFFICIENCY = 0.62
CALIBRATED_PARALLEL_EFFICIENCY = 0.8
# the same with the expert quantizer's own forward, long enough to keep every core busy beside the pack workers: on
# Zen 3, 2 cores, the DeepSeek-V3-shaped calibrated default used ~1.0 of the cores between its serial parts (float32:
# 209 CPU-s in 114 s wall; tiles: 182 in 101); on Zen 4 with the bf16 forward, 1.0 too (samples in CPU seconds: ~105
# CPU-s of work in ~53 s between the serial parts, bench_convert.py's 2 rounds)
BUSY_CALIBRATED_PARALLEL_EFFICIENCY = 1.0
FORWARD_MATMUL_SHARE = 0.5     # measured: matmuls were 46% of a DeepSeek-V3-shaped calibration layer (bf16)
FLOAT32_FORWARD_MATMUL_SHARE = 0.75   # the same in float32 (Zen 3: ~51 s of matmuls in ~68 s of forward, perf and py-spy)
# the expert quantizer's own bf16 forward since its weights are read as bf16 and the prior's rows ride in its products
# (torch.profiler over a DeepSeek-V3-shaped layer, Zen 4, 2 threads: aten::mm 7.3 s of 9.3 s)
BF16_FORWARD_MATMUL_SHARE = 0.78
# the int4-tile forward's work besides its products (attention scores, norms, routing, gathers, casts), in units of
# the float32 forward's matmul time: fitted to bench_convert.py's DeepSeek-V3-shaped calibrated default (Zen 3, 2 cores,
# 2 rounds: 104.3 / 98.1 s wall)
TILE_FORWARD_REST = 0.3
ROUTING_SPREAD = 0.25          # routed tokens per expert: standard deviation / mean
WARMUP_SECONDS = 1.0           # matmul calls before the timed ones (0.3 s left MKL slow on Zen 3: 88-119 vs 180 GFLOPS)


@dataclass
class Estimate:
    seconds: float                                      # the predicted wall time
    parts: dict[str, float] = field(default_factory=dict)   # startup, experts / dense / forward (CPU seconds), write
    sample_seconds: float = 0.0       # what timing the sample took (quantize spends it too: in seconds)

    def line(self) -> str:
        parts = ", ".join(f"{k} {_dur(v)}" for k, v in self.parts.items())
        total = _dur(self.seconds) + ("" if self.seconds < 300 else f" = {self.seconds:.0f} s")
        return f"estimated conversion time on this machine: {total} ({parts}; timed sample " \
               f"{self.sample_seconds:.1f} s; the model: ktconvert/README.md)"


def _dur(s: float) -> str:
    if s < 300:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s" if s >= 0.1 else f"{s:.2f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def process_age() -> float:
    """Seconds since this process started (/proc; 0 where there is none)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def share_at_or_above(threshold: float, mean: float) -> float:
    """P(n >= threshold) for n ~ Normal(mean, ROUTING_SPREAD x mean)."""
    if mean <= 0:
        return 0.0
    z = (threshold - mean) / (ROUTING_SPREAD * mean)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def estimate_conversion(src, opts, plan, encoder, quantizer, out_dir: Path | None = None) -> Estimate:
    """The conversion `opts` (resolved ConvertOptions) of `src` with its plan, dense encoder and expert quantizer
    (None: the layout's reference rule), as pipeline.convert builds them, into out_dir (None: the current
    directory; the write sample goes to its nearest existing folder)."""
    # Python's cyclic collector off while the samples run: the imports beside them allocate a lot, and a collection
    # runs on whichever thread allocates (a sample's CPU seconds on the default model went 2 -> 9 s with one)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _estimate(src, opts, plan, encoder, quantizer, out_dir)
    finally:
        if enabled:
            gc.enable()


def _estimate(src, opts, plan, encoder, quantizer, out_dir: Path | None) -> Estimate:
    t0 = time.perf_counter()
    startup = process_age()
    geo = plan.geometry
    moe_layers = sorted({j.layer for g in plan.jobs for j in g if j.kind == "expert"})
    calibrated = bool(quantizer is not None and quantizer.calibrated) or getattr(encoder, "calibrated", False)
    tokens = opts.calib_tokens
    parts: dict[str, float] = {"startup": startup}
    imports = _Imports(src) if calibrated else None
    if imports is not None:
        imports.start()
    clock = _CpuClock(imports)

    expert_cpu, read_rate = 0.0, None
    if moe_layers:
        per_expert, read_rate = _expert_sample(src, geo, moe_layers[0], quantizer, tokens, opts, clock)
        n_experts = sum(1 for g in plan.jobs for j in g if j.kind == "expert" and j.shard in (0, None)) * geo.n_experts
        expert_cpu = per_expert * n_experts
    parts["experts"] = expert_cpu

    dense_jobs = [j for g in plan.jobs for j in g if j.kind != "expert"]
    sample = _dense_sample_job(dense_jobs, moe_layers)
    dense_cpu = 0.0
    if sample is not None:
        rates = _dense_sample(src, sample, encoder, clock)
        if not getattr(encoder, "calibrated", False):         # cheap: again, warm (as for the experts)
            rates = _dense_sample(src, sample, encoder, clock)
        for j in dense_jobs:
            for name, role in j.sources:
                kind, units = _dense_units(src, encoder, name, role)
                dense_cpu += units * rates.get(kind, rates.get("bytes", 0.0))
    parts["dense"] = dense_cpu

    forward = forward_cpu = 0.0
    if calibrated:
        t = time.perf_counter()
        imports.join()                        # transformers and the family's modeling module: part of the run
        _import_calibration(src)              # (again: an import that failed there raises here)
        parts["startup"] += time.perf_counter() - t
        forward, forward_cpu = _forward_seconds(src, plan, quantizer, encoder, tokens, read_rate)
        parts["forward"] = forward

    mix = 0.0
    if calibrated and _measures_mix(encoder):
        mix = parts["mix"] = forward + dense_cpu + _layer_reruns(src, encoder, tokens)

    out_bytes = sum(spec.nbytes for g in plan.jobs for j in g for spec in j.specs)
    parts["write"] = out_bytes * _write_seconds_per_byte(out_dir)

    from ktconvert.pipeline import release_read_buffer

    cores = min(opts.workers + (1 if calibrated else 0), usable_cpus())
    work = expert_cpu + dense_cpu + forward_cpu
    release_read_buffer()                    # the expert sample's, on this thread: the conversion's are its workers'
    # quantize times this sample before it starts (the imports in it are part of the run anyway: in startup)
    sample = time.perf_counter() - t0 - (parts["startup"] - startup)
    efficiency = (BUSY_CALIBRATED_PARALLEL_EFFICIENCY if _own_calibration_matmul(quantizer) is not None
                  else CALIBRATED_PARALLEL_EFFICIENCY) if calibrated else PARALLEL_EFFICIENCY
    wall = parts["startup"] + sample + mix + max(forward, work / (cores * efficiency)) + parts["write"]
    return Estimate(wall, parts, sample)


class _Imports(threading.Thread):
    """transformers' modeling modules for the calibration forward (~2 s of imports, mostly holding the GIL) loaded on
    a thread of their own while the samples run (mostly in C, without it): the forward's term joins it. cpu() is its
    CPU seconds so far, which the samples' clock leaves out (_CpuClock). An import that fails here is left to the
    forward's term, which imports again and raises."""

    def __init__(self, src):
        super().__init__(name="ktconvert-imports", daemon=True)
        self.src, self.final, self.error = src, None, None

    def run(self) -> None:
        try:
            _import_calibration(self.src)
        except Exception as e:               # noqa: BLE001 - raised again by the caller's own import
            self.error = e
        finally:
            self.final = time.thread_time()

    def cpu(self) -> float:
        if self.ident is None:               # not started
            return 0.0
        if self.final is None:
            try:
                return time.clock_gettime(time.pthread_getcpuclockid(self.ident))
            except OSError:                  # it ended between the check and the read
                self.join()
        return self.final


class _CpuClock:
    """CPU seconds of this process (every thread: a sample's torch calls run on several), less those of the imports
    beside it: the samples are CPU seconds of work (the model divides them by the cores), not the wall time they took
    while sharing the cores."""

    def __init__(self, imports: _Imports | None):
        self.imports = imports

    def __call__(self) -> float:
        return time.process_time() - (self.imports.cpu() if self.imports is not None else 0.0)


def _measures_mix(encoder) -> bool:
    """Whether the conversion runs the measured mixed-precision pass first (the encoder's own measures_mix: BF16
    encoders have none); not when it has run already (quantize plans after it: its time is in startup then)."""
    return getattr(encoder, "measures_mix", lambda: False)() and not getattr(encoder, "mix_applied", False)


def _layer_reruns(src, encoder, tokens: int) -> float:
    """Seconds of the sensitivity pass's layer re-runs: each quantized Linear of a layer runs the layer's Linears
    (no routed experts) once more over the calibration tokens, float32."""
    import torch

    arch = src.arch
    per_layer: dict[int, list[int]] = {}          # layer -> [parameters of its 2-D Linears, quantized ones]
    for name in src.tensor_names():
        role = arch.classify(name)
        info = src.info(name)
        if role.kind in ("expert", "skip") or role.layer is None or len(info.shape) != 2:
            continue
        acc = per_layer.setdefault(role.layer, [0, 0])
        acc[0] += math.prod(info.shape)
        acc[1] += bool(encoder.quantizes(name, tuple(info.shape), role))
    rate = _matmul_rate(arch.hidden_size, max(1, arch.moe_intermediate_size or arch.hidden_size), torch.float32)
    return sum(2 * tokens * p * n for p, n in per_layer.values()) / rate / FORWARD_MATMUL_SHARE


WRITE_SAMPLE_BYTES = 32 << 20


def _write_seconds_per_byte(out_dir: Path | None) -> float:
    """Seconds per byte of what a file's commit costs on the main thread (AlignedWriter): write, fsync, and the
    sha256 read back, timed on WRITE_SAMPLE_BYTES in a temporary file beside the output."""
    from ktlayouts.files import sha256_file

    where = Path(out_dir).resolve() if out_dir is not None else Path.cwd()
    while not where.is_dir():
        where = where.parent
    data = np.random.default_rng(0).integers(0, 256, WRITE_SAMPLE_BYTES, dtype=np.uint8)
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".ktconvert-estimate-") as f:
            t = time.perf_counter()
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
            sha256_file(f.name)
            return (time.perf_counter() - t) / WRITE_SAMPLE_BYTES
    except OSError:              # not writable: no sample, no term
        return 0.0


def _expert_sample(src, geo, layer: int, quantizer, tokens: int, opts, clock=time.process_time
                   ) -> tuple[float, float]:
    """(CPU seconds of one routed expert by `clock`, seconds per source byte of reading one) on expert 0 of `layer`,
    the read timed inside the pack path itself (its TimeShares)."""
    from ktconvert.pipeline import _pack_expert
    from ktconvert.time_shares import TimeShares

    nbytes = sum(src.info(src.arch.expert_tensor_name(layer, 0, p)).nbytes for p in ("gate", "up", "down"))
    shards = list(range(geo.numa_nodes))
    if quantizer is None or quantizer.mode == "rtn" or not quantizer.calibrated:
        for _ in range(2):          # the second: the first pays for memory this process touches the first time
            shares = TimeShares()
            t = clock()
            _pack_expert(src, src.arch, geo, layer, 0, shares=shares, shards=shards, bf16_scales=opts.bf16_scales,
                         quantizer=quantizer)
            seconds = clock() - t
        return seconds, shares.seconds["read"] / max(1, nbytes)
    k = max(1, src.arch.top_k or 1)
    mean = tokens * k / max(1, geo.n_experts)
    threshold = quantizer.min_tokens or geo.intermediate // 2     # GPTQ on down at >= K/2 tokens (ExpertQuantizer)
    above = share_at_or_above(threshold, mean) if quantizer.mode == "gptq" else 0.0
    runs, shares = [], TimeShares()
    for share, n in ((above, max(threshold, round(mean))), (1.0 - above, min(threshold - 1, round(mean)))):
        if share >= 0.01:
            runs.append((share, _timed_calibrated_expert(src, geo, layer, shards, quantizer, max(1, n), opts,
                                                         shares, clock)))
    read_rate = shares.seconds["read"] / len(runs) / max(1, nbytes)
    return sum(s * t for s, t in runs) / sum(s for s, _ in runs), read_rate


def _timed_calibrated_expert(src, geo, layer: int, shards, quantizer, n: int, opts, shares,
                             clock=time.process_time) -> float:
    """Seconds by `clock` of _pack_expert on expert 0 of `layer` with synthetic calibration inputs: n routed tokens
    of Gaussian inputs (the arithmetic of GPTQ and the search does not depend on the values); its read and quantize
    seconds are added to shares."""
    import torch

    from ktconvert.gpu.calib import prior_rows
    from ktconvert.pipeline import _pack_expert
    from ktconvert.quantizers.experts import ExpertQuantizer

    q = ExpertQuantizer(quantizer.mode, lambda: None, quantizer.min_tokens, quantizer.scale_dtype, quantizer.percdamp)
    g = torch.Generator().manual_seed(0)
    total = max(n, 256)
    x = torch.randn(total, geo.hidden, generator=g)
    ids = torch.full((total, 1), 1, dtype=torch.long)
    ids[:n] = 0                                                        # expert 0 gets n of the tokens
    # the calibration forward computes the prior's rows (their cost is in _forward_seconds)
    prior = {0: torch.randn(prior_rows(x).shape[0], geo.intermediate, generator=g)}
    q.use_inputs(layer, x, ids, {0: torch.randn(n, geo.intermediate, generator=g)}, prior)
    t = clock()
    _pack_expert(src, src.arch, geo, layer, 0, shards, bf16_scales=opts.bf16_scales, quantizer=q, shares=shares)
    return clock() - t


def _dense_sample_job(dense_jobs, moe_layers):
    """The dense file of the first MoE layer (else the first dense file with tensors)."""
    first = moe_layers[0] if moe_layers else None
    with_sources = [j for j in dense_jobs if j.sources]
    return next((j for j in with_sources if j.layer == first), with_sources[0] if with_sources else None)


DENSE_SAMPLE_BYTES = 32 << 20     # source bytes of the dense sample (its smallest tensors first)


def _dense_units(src, encoder, name: str, role) -> tuple[str, float]:
    """(kind, work units) of encoding one dense tensor: GPTQ'd Linears ("gptq") cost what GPTQ's arithmetic does,
    N K^2 + K^3 / 3 for a (N, K) weight (the error updates and the Cholesky factor); everything else ("bytes") its
    source bytes."""
    info = src.info(name)
    shape = tuple(info.shape)
    if getattr(encoder, "calibrated", False) and not getattr(role, "mtp", False) and \
            encoder.quantizes(name, shape, role):
        n, k = shape
        return "gptq", float(n) * k * k + k ** 3 / 3.0
    return "bytes", float(info.nbytes)


def _dense_sample(src, job, encoder, clock=time.process_time) -> dict[str, float]:
    """{kind: seconds by `clock` per work unit (_dense_units)} of reading and encoding tensors of one dense file: the
    smallest first, until DENSE_SAMPLE_BYTES (a norm and a Linear or two)."""
    import torch

    picked, nbytes = [], 0
    for name, role in sorted(job.sources, key=lambda nr: src.info(nr[0]).nbytes):
        if nbytes >= DENSE_SAMPLE_BYTES:
            break
        picked.append((name, role))
        nbytes += src.info(name).nbytes
    seconds: dict[str, float] = {}
    units: dict[str, float] = {}
    for name, role in picked:
        kind, u = _dense_units(src, encoder, name, role)
        t = clock()
        tensor = src.read(name)
        if kind == "gptq":
            x = torch.randn(256, tensor.shape[1], generator=torch.Generator().manual_seed(0))
            encoder.quantize_calibrated(name, tensor, 2.0 * x.T @ x / 256)
        else:
            encoder.encode(name, tensor.numpy(), role)
        seconds[kind] = seconds.get(kind, 0.0) + clock() - t
        units[kind] = units.get(kind, 0.0) + u
    return {k: seconds[k] / max(units[k], 1.0) for k in seconds}


def _import_calibration(src) -> None:
    """Import what the calibration forward imports (transformers' config and decoder-layer classes)."""
    from ktconvert.gpu.calib import _model_classes, hf_config, text_model_of

    _model_classes(hf_config(*text_model_of(src)))


def _forward_seconds(src, plan, quantizer, encoder, tokens: int, read_rate: float | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of the calibration forward over all layers (the model in this module's
    docstring)."""
    import torch

    from ktconvert.gpu.calib import PRIOR_SAMPLE

    arch = src.arch
    own = _own_calibration_matmul(quantizer)
    matmul = own or "float32"
    k, n = arch.hidden_size, max(1, arch.moe_intermediate_size or arch.hidden_size)
    rate = _matmul_rate(k, n, torch.bfloat16 if matmul == "bfloat16" else torch.float32)
    linear: dict[int, int] = {}                  # layer -> parameters of its 2-D non-expert weights
    for name in src.tensor_names():
        role = arch.classify(name)
        info = src.info(name)
        if role.kind not in ("expert", "skip") and role.layer is not None and len(info.shape) == 2 \
                and not getattr(role, "mtp", False):
            linear[role.layer] = linear.get(role.layer, 0) + math.prod(info.shape)
    geo = plan.geometry
    per_expert = 3 * geo.hidden * geo.intermediate
    moe = set(geo.moe_layers)
    hit = 1.0 - (1.0 - arch.top_k / max(1, geo.n_experts)) ** tokens    # share of experts the forward runs
    # GPTQ GPU layers: a first pass (experts skipped) collects the Hessians, a second runs the quantized layer
    passes = 2 if getattr(encoder, "calibrated", False) else 1
    flops = sum(2 * tokens * (passes * p + (arch.top_k * per_expert if layer in moe else 0))
                for layer, p in linear.items())
    # the prior's rows (ktconvert.gpu.calib.prior_rows) through each hit expert's gate / up
    flops += len(moe) * geo.n_experts * hit * 2 * min(tokens, PRIOR_SAMPLE) * 2 * geo.hidden * geo.intermediate
    threads = torch.get_num_threads()       # the matmuls run on all of them, the rest on one
    share = {"float32": FLOAT32_FORWARD_MATMUL_SHARE, "bfloat16": BF16_FORWARD_MATMUL_SHARE}.get(own,
                                                                                               FORWARD_MATMUL_SHARE)
    seconds = flops / rate / share
    cpu_per_second = share * threads + 1 - share
    if matmul == "kernels":     # the products on int4 tiles (all threads), the rest and the tiling on one thread
        tile_rate, per_weight = _tile_rate(k, n)
        tiled = sum(linear.values()) + len(moe) * geo.n_experts * hit * per_expert
        products = flops / tile_rate
        rest = TILE_FORWARD_REST * flops / rate + tiled * per_weight
        seconds = products + rest
        cpu_per_second = (products * threads + rest) / seconds
    if passes == 2:                # each GPTQ'd Linear's Hessian H += X^T X over the tokens: 2 T K^2, float32
        hess = sum(2.0 * tokens * src.info(n).shape[1] ** 2 for g in plan.jobs for j in g if j.kind != "expert"
                   for n, role in j.sources if _dense_units(src, encoder, n, role)[0] == "gptq")
        seconds += hess / rate
    if read_rate is not None:
        names = [arch.expert_tensor_name(geo.moe_layers[0], 0, p) for p in ("gate", "up", "down")]
        expert_bytes = sum(src.info(name).nbytes for name in names)
        if matmul == "bfloat16" and hasattr(src, "read_bf16"):
            # the bf16 forward reads its experts as stored (StreamingExperts: read_bf16), not widened to float32
            # as the pack path's sample read them: timed here on the same expert
            t = time.perf_counter()
            for name in names:
                src.read_bf16(name)
            read_rate = (time.perf_counter() - t) / max(1, expert_bytes)
        seconds += len(moe) * geo.n_experts * hit * expert_bytes * read_rate
    return seconds, seconds * cpu_per_second


def _own_calibration_matmul(quantizer) -> str | None:
    """How the expert quantizer's own calibration forward multiplies (ktconvert.gpu.calib.calibration_matmul); None
    where it has none (no calibration, or the GPU layers' GPTQ drives it: a float32 forward fitted on its own)."""
    if quantizer is None or not quantizer.calibrated or not getattr(quantizer, "own_calibration", False):
        return None
    from ktconvert.gpu.calib import calibration_matmul
    return calibration_matmul()


def _tile_rate(k: int, n: int, m: int = 512) -> tuple[float, float]:
    """(multiply-adds x 2 per second of an (m, k) x (k, n) product on the calibration forward's int4 tiles, seconds
    per weight of quantizing a weight onto them): the best of 5 after WARMUP_SECONDS of calls."""
    import torch

    from ktconvert.gpu.calib_kernels import TileMatmuls, tile_group

    if tile_group(k) is None:
        return _matmul_rate(k, n, torch.float32, m), 0.0
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    tiles = TileMatmuls()
    try:
        best_q = best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            tiles.register(0, w)
            best_q = min(best_q, time.perf_counter() - t)
        warm = time.perf_counter()
        while time.perf_counter() - warm < WARMUP_SECONDS:
            tiles.run([0], a)
        for _ in range(5):
            t = time.perf_counter()
            tiles.run([0], a)
            best = min(best, time.perf_counter() - t)
    finally:
        tiles.close()
    return 2.0 * m * k * n / best, best_q / w.numel()


def _matmul_rate(k: int, n: int, dtype, m: int = 512) -> float:
    """FLOP/s of an (m, k) x (k, n) matmul as the calibration forward runs it (bf16: under CPU autocast, float32 inputs
    and bf16 weights, which the forward reads as such): the best of 5 calls after WARMUP_SECONDS of them."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    if dtype == torch.bfloat16:
        b = b.to(torch.bfloat16)
    best, warm = float("inf"), time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        while time.perf_counter() - warm < WARMUP_SECONDS:      # the first calls of a process are slow
            a @ b.T
        for _ in range(5):
            t = time.perf_counter()
            a @ b.T
            best = min(best, time.perf_counter() - t)
    return 2.0 * m * k * n / best
