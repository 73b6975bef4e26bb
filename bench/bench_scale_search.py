"""The converter's importance-weighted scale search (kt_search_scales: ktconvert.scale_search.search_scales on the
library) on one DeepSeek-V3-shaped expert matrix, one thread: milliseconds per matrix and nanoseconds per group, for
4 and 8 bits and groups of 64 and 32, against two things measured in the same run, alternated round by round:
- the torch reference (`KTCONVERT_SEARCH=torch`, the same rule in torch on the same thread count: the peer);
- the plain rule (largest magnitude onto the most negative code, `ktconvert.scale_search.codes_for`'s division and
  rounding once per value): the floor, what any per-group rule pays to look at the matrix once.
The search tries 22 scales per group (trial_divisors), so it cannot get near the floor; the ratio says how far.
The run checks that the kernel's output is the same in every round.

    .venv/bin/python bench/bench_scale_search.py                  # ~1 minute on 2 cores
    .venv/bin/python bench/bench_scale_search.py --rows 2048 --rounds 5
Output: `name: value unit` lines.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=7168, help="output rows of the matrix (DeepSeek-V3's down: 7168)")
    ap.add_argument("--cols", type=int, default=2048, help="input columns (DeepSeek-V3's expert intermediate: 2048)")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds; medians are printed")
    ap.add_argument("--torch-rows", type=int, default=512,
                    help="rows the (slow) torch reference runs on; its time is scaled to the whole matrix")
    a = ap.parse_args(argv)

    from ktrun.ops.library import kernels_available

    from ktconvert import scale_search as ss
    if not kernels_available():
        print("error: libktkernels is not built (make kernels)", file=sys.stderr)
        return 1
    torch.set_num_threads(1)                  # the converter runs one search per worker thread
    g = torch.Generator().manual_seed(0)
    w = torch.randn(a.rows, a.cols, generator=g) * 0.02
    w[:, ::97] *= 8                           # outlier channels, as trained weights have
    print(f"matrix: {a.rows} x {a.cols} float32, 1 thread")
    for bits in (4, 8):
        for group in (64, 32):
            x = w.reshape(-1, group)
            imp = torch.rand(a.cols // group, group, generator=g) + 0.1      # one importance row per input group
            part = x[: a.torch_rows * a.cols // group]
            times = {"kernel": [], "torch": [], "plain": []}
            digests = set()
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                s, q = ss.search_scales(x, imp, bits, "f16")
                times["kernel"].append(time.perf_counter() - t0)
                digests.add(hashlib.sha256(s.numpy().tobytes() + q.numpy().tobytes()).hexdigest())
                os.environ[ss.SEARCH_IMPL_ENV] = "torch"
                try:
                    t0 = time.perf_counter()
                    ss.search_scales(part, imp, bits, "f16")
                    times["torch"].append((time.perf_counter() - t0) * x.shape[0] / part.shape[0])
                finally:
                    del os.environ[ss.SEARCH_IMPL_ENV]
                t0 = time.perf_counter()
                hi, lo = x.amax(1), x.amin(1)
                ss.codes_for(x, ss.round_scales(torch.where(hi >= -lo, hi, lo) / -(1 << (bits - 1)), "f16"), bits)
                times["plain"].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            tag = f"int{bits}_g{group}"
            for name, value, unit in (
                    ("kernel", f"{1e3 * med['kernel']:.1f}", "ms"),
                    ("kernel_per_group", f"{1e9 * med['kernel'] / x.shape[0]:.0f}", "ns"),
                    ("torch_reference", f"{1e3 * med['torch']:.1f}", "ms"),
                    ("plain_rule", f"{1e3 * med['plain']:.1f}", "ms"),
                    ("speedup_vs_torch", f"{med['torch'] / med['kernel']:.1f}", "x"),
                    ("over_plain_rule", f"{med['kernel'] / med['plain']:.2f}", "x"),
                    ("same_output_every_round", str(int(len(digests) == 1)), "bool")):
                print(f"search_{tag}_{name}: {value} {unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
