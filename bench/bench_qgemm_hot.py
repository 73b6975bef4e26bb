"""Benchmark: the compute rate of the decode kernel body, weights hot in L2, against one thread's memory bandwidth.

Builds bench/qgemm_hot.cpp (the AVX-512 VNNI body of kernels/src/kernel_body.inc, which the avx512 and amx backends
run for decode rows; on a CPU whose backend is avx2, that backend's body: vpmaddubsw + vpmaddwd; g++ with the
library's flags for it, into a temporary directory) and runs it on one CPU: one (N = 128, K = 7168) matrix (N = 32
for the avx2 body, whose CPUs have 256 KB-1 MB of L2), small enough to stay in L2, streamed by qgemm for T = 1, 2,
4, 8 rows (more: the prefill tiles, reused from L2), int4 with f16
group-64 scales and with two-level (sub6) scales (both 4.25 bits/weight), and int8 f16 group 32, timed alternately.
Then the library's read-bandwidth probe with one thread (kt_measure_read_bandwidth, --probe-mb). A rate well above the
probe means that a decode step with these weights in memory is bound by memory, not by the kernel's arithmetic
(`..._over_memory`); bench_moe_kernels.py then shows how close the layer gets to that bound.

    .venv/bin/python bench/bench_qgemm_hot.py                    # T = 1 2 4 8
    .venv/bin/python bench/bench_qgemm_hot.py --tokens 1 4 --cpu 1
    .venv/bin/python bench/bench_qgemm_hot.py --tokens 1 4 64      # 64 rows: the prefill tiles
Output lines are `name: value unit`. Needs g++ and an AVX2 or AVX-512 VNNI CPU (else it says so and exits 0).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["-O3", "-std=c++17", "-fno-math-errno", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2",
         "-mfma"]
AVX2_FLAGS = ["-O3", "-std=c++17", "-fno-math-errno", "-mavx2", "-mfma", "-mf16c", "-DKT_HOT_AVX2"]   # CMakeLists.txt's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds, best kept")
    ap.add_argument("--cpu", type=int, default=None, help="pin to this CPU (default: the last one allowed)")
    ap.add_argument("--probe-mb", type=int, default=512, help="bytes the read-bandwidth probe streams")
    args = ap.parse_args()
    from ktrun.ops.moe import MoEKernels
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    with MoEKernels(n_threads=1) as moe:
        backend = moe.backend
        if backend not in ("avx512", "amx", "avx2"):
            print(f"# backend {backend}: no AVX2 or AVX-512 VNNI on this CPU, nothing to measure")
            return
        avx2 = backend == "avx2"
        cxx = shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            sys.exit("error: needs g++ (or c++) to build bench/qgemm_hot.cpp")
        with tempfile.TemporaryDirectory() as tmp:
            exe = Path(tmp) / "qgemm_hot"
            subprocess.run([cxx, *(AVX2_FLAGS if avx2 else FLAGS), "-I", str(REPO / "kernels" / "src"),
                            str(REPO / "bench" / "qgemm_hot.cpp"), "-o", str(exe)], check=True)
            bw = moe.measure_read_bandwidth(args.probe_mb << 20, 4)
            out = subprocess.run(["taskset", "-c", str(cpu), str(exe), "2" if avx2 else "8", str(args.rounds),
                                  *map(str, args.tokens)], check=True, capture_output=True, text=True).stdout
            bw = max(bw, moe.measure_read_bandwidth(args.probe_mb << 20, 4))
            peak = moe.measure_int8_peak()          # the pool's one thread: register-only int8 products
    print(f"# one thread on CPU {cpu}, backend {backend} (its decode rows run this body)")
    print(out, end="")
    print(f"read_bandwidth_1t: {bw / 1e9:.2f} GB/s (probe, best of before/after)")
    print(f"int8_peak_1t: {peak / 1e9:.1f} GOP/s (probe)")
    for m in re.finditer(r"^qgemm_hot_(\w+?)_T(\d+): ([\d.]+) GB/s$", out, re.MULTILINE):
        print(f"qgemm_hot_{m[1]}_T{m[2]}_over_memory: {float(m[3]) * 1e9 / bw:.2f} x the read bandwidth")
    for m in re.finditer(r"^qgemm_hot_(\w+?)_T(\d+)_compute: ([\d.]+) GOP/s$", out, re.MULTILINE):
        print(f"qgemm_hot_{m[1]}_T{m[2]}_over_int8_peak: {float(m[3]) * 1e9 / peak:.2f} of the int8 peak")


if __name__ == "__main__":
    main()
