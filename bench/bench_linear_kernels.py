"""Benchmark: DeepSeek-V3's non-expert Linears on libktkernels' dense Linear op (ktrun.ops.linear).

Shapes (N x K): q_a 1536x7168, q_b 24576x1536, kv_a 576x7168, kv_b 32768x512, o_proj 7168x16384, the shared
expert's gate+up (two 2048x7168 Linears sharing x, one submission) and down 7168x2048, and the head 129280x7168
(--head-rows, default a quarter of it so the float32 comparison fits this box). int4 and int8, group 128, T = 1, 64,
512 tokens, 1 and 2 threads. Each Linear is cycled over copies of itself (--rotate-mb of weights in all) so the small
ones are read from memory, as in a model, not from L3.

For each configuration: time per call (best of the reps), weight bytes read per second and that as a fraction of the
read bandwidth measured in the same run (bench_moe_kernels.probe: kt_measure_read_bandwidth with the same pool); for
T >= 64 also int8 GOP/s against the register-only vpdpbusd peak (kt_measure_int8_peak); and a torch float32 matmul
of the same shape on the same number of threads (ratio = torch time / kernel time). The four are sampled in three
rounds of (probe, kernel, torch) closed by a probe, best of each (see measure()). Then the GPU-code repack on an
o_proj-sized matrix (7168x16384 int4): MB/s of codes from (K, N) bytes, gptq words and compressed-tensors
words.
Output lines are `name: value unit`.

    .venv/bin/python bench/bench_linear_kernels.py                        # everything (~10 minutes)
    .venv/bin/python bench/bench_linear_kernels.py --shapes o_proj kv_a --tokens 1 --threads 2 --bits 4
"""
from __future__ import annotations

import argparse
import time
from functools import partial

import numpy as np
import torch
from bench_moe_kernels import probe
from ktlayouts.cpu_linear import linear_geometry
from ktlayouts.gptq import pack_rows
from ktrun.ops.linear import LinearKernels

GROUP = 128
# name: list of (N, K) Linears sharing one input (more than one: a fused submission)
SHAPES = {
    "q_a": [(1536, 7168)], "q_b": [(24576, 1536)], "kv_a": [(576, 7168)], "kv_b": [(32768, 512)],
    "o_proj": [(7168, 16384)], "shared_gate_up": [(2048, 7168), (2048, 7168)], "shared_down": [(7168, 2048)],
    "head": [(129280, 7168)],
    # Qwen3-30B-A3B's attention (GQA 32 / 4 heads of 128, hidden 2048): q, k, v in one submission, then o_proj
    "qwen3_qkv": [(4096, 2048), (512, 2048), (512, 2048)], "qwen3_o": [(2048, 4096)],
}


def random_copies(geoms, copies: int, rng: np.random.Generator) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """`copies` sets of packed (qweight, scales) per geometry, random codes and scales (only the addresses matter
    for speed), carved out of one arena per tensor kind as a loader would place repacked layers: large allocations
    get transparent huge pages, a 2 MB Linear on its own would not (measured: kv_a T=1 84 vs 100 us). Every page is
    written, so no read can hit the shared zero page."""
    q_sizes = [g.qweight_nbytes for g in geoms]
    s_sizes = [g.scales_nbytes // 4 for g in geoms]
    q_arena = np.empty(copies * sum(q_sizes), np.uint8)
    block = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
    for i in range(0, q_arena.size, block.size):
        n = min(block.size, q_arena.size - i)
        q_arena[i:i + n] = block[:n]
        block[:64] = rng.integers(0, 256, size=64, dtype=np.uint8)
    s_arena = (rng.standard_normal(copies * sum(s_sizes)) * 1e-3).astype(np.float32)
    out, qo, so = [], 0, 0
    for _ in range(copies):
        out.append([])
        for g, qn, sn in zip(geoms, q_sizes, s_sizes):
            out[-1].append((q_arena[qo:qo + qn].reshape(g.qweight_shape), s_arena[so:so + sn].reshape(g.scales_shape)))
            qo, so = qo + qn, so + sn
    return out


def measure(lin: LinearKernels, ids: list[list[int]], x: np.ndarray, outs: list, torch_mm, reps: int,
            rounds: int = 3) -> dict[str, float]:
    """Rounds of (probe, kernel block, torch block), then a last probe; the best of each over all rounds, so the
    kernel, its limits and the peer are sampled in the same stretches of time on this shared machine.
    The kernel cycles over the weight copies. torch's OpenMP threads keep spinning on the cores for a while after
    each call, so the first call of each block is a warm-up and not timed. cpu_share: CPU time the process got
    during the kernel blocks / (their wall time x threads), below 1 when other processes take the cores."""
    best = {"kernel": float("inf"), "torch": float("inf"), "bw": 0.0, "peak": 0.0}
    wall = cpu = 0.0
    for r in range(rounds + 1):
        bw, peak, _ = probe(lin.kernels)   # (read, vpdpbusd peak, tile peak)
        best["bw"], best["peak"] = max(best["bw"], bw), max(best["peak"], peak)
        if r == rounds:
            break
        lin.forward(ids[0], x, outs)
        w0, c0 = time.perf_counter(), time.process_time()
        for i in range(reps):
            t0 = time.perf_counter()
            lin.forward(ids[(i + 1) % len(ids)], x, outs)
            best["kernel"] = min(best["kernel"], time.perf_counter() - t0)
        wall, cpu = wall + time.perf_counter() - w0, cpu + time.process_time() - c0
        if torch_mm:
            torch_mm()
            for _ in range(reps):
                t0 = time.perf_counter()
                torch_mm()
                best["torch"] = min(best["torch"], time.perf_counter() - t0)
    best["cpu_share"] = cpu / (wall * lin.n_threads)
    return best


def torch_matmuls(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x @ w.T for w in weights]


def bench_repack(lin: LinearKernels, nt: int, rng: np.random.Generator) -> None:
    n, k, bits = 7168, 16384, 4
    codes = rng.integers(0, 16, size=(k, n), dtype=np.uint8)
    scales = (rng.standard_normal((k // GROUP, n)) * 1e-2).astype(np.float16)
    words = pack_rows(codes, bits)
    geom = linear_geometry(n, k, bits, GROUP)
    out = (np.empty(geom.qweight_shape, np.uint8), np.empty(geom.scales_shape, np.float32))
    out[0].fill(0), out[1].fill(0)
    ct_words = np.ascontiguousarray(words.T)     # compressed-tensors weight_packed (N, K/8), read as its .T view
    for name, c, packed in (("u8_kn", codes, False), ("gptq_words", words, True), ("ct_words", ct_words.T, True)):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            lin.repack(c, scales, bits, GROUP, packed=packed, out=out)
            best = min(best, time.perf_counter() - t0)
        print(f"repack_o_proj_int4_{name}_{nt}t_time: {best * 1e3:.1f} ms")
        print(f"repack_o_proj_int4_{name}_{nt}t_codes: {n * k / best / 1e6:.0f} MB/s (one code per byte)")
        print(f"repack_o_proj_int4_{name}_{nt}t_input: {c.nbytes / best / 1e6:.0f} MB/s (source bytes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--head-rows", type=int, default=129280 // 4, help="rows of the head Linear (129280 is V3's)")
    ap.add_argument("--rotate-mb", type=float, default=256.0, help="weights cycled per configuration (> L3)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch float32 comparison")
    ap.add_argument("--no-repack", action="store_true", help="skip the repack measurement")
    ap.add_argument("--backend", default=None, help="scalar|avx2|avx512|amx (default: best of this CPU)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shapes = {name: SHAPES[name] for name in args.shapes}
    if "head" in shapes:
        shapes["head"] = [(args.head_rows, 7168)]

    for name, mats in shapes.items():
        k = mats[0][1]
        for bits in args.bits:
            geoms = [linear_geometry(n, k, bits, GROUP) for n, _ in mats]
            nbytes = sum(g.qweight_nbytes + g.scales_nbytes for g in geoms)
            copies = max(1, int(np.ceil(args.rotate_mb * 1e6 / nbytes)))
            t0 = time.perf_counter()
            weights = random_copies(geoms, copies, rng)
            print(f"linear_{name}_int{bits}: {' + '.join(f'{n}x{k}' for n, _ in mats)}, {nbytes / 1e6:.1f} MB, "
                  f"{copies} copies (packed in {time.perf_counter() - t0:.1f} s)")
            w32 = [torch.randn(n, k) for n, _ in mats] if not args.no_torch else []
            for nt in args.threads:
                torch.set_num_threads(nt)
                with LinearKernels(n_threads=nt, backend=args.backend) as lin:
                    print(f"backend: {lin.kernels.backend_detail}, {nt} thread(s) pinned to CPUs "
                          f"{[cpu for _, cpu in lin.kernels.thread_cpus()]}, torch {torch.get_num_threads()} thread(s)")
                    ids = []
                    for c, packed in enumerate(weights):
                        ids.append([])
                        for j, (g, (q, s)) in enumerate(zip(geoms, packed)):
                            lin.add(c * len(geoms) + j, q, s, g.n, g.k, bits, GROUP)
                            ids[-1].append(c * len(geoms) + j)
                    for T in args.tokens:
                        x = rng.standard_normal((T, k)).astype(np.float32)
                        outs = [np.empty((T, g.n), np.float32) for g in geoms]
                        torch_mm = partial(torch_matmuls, torch.from_numpy(x), w32) if w32 else None
                        macs = T * sum(g.n * g.k for g in geoms)
                        reps = max(2, min(30, int(0.1 / max(nbytes / 20e9, 2 * macs / 400e9))))
                        m = measure(lin, ids, x, outs, torch_mm, reps)
                        sec, sec_torch, bw, peak = m["kernel"], m["torch"], m["bw"], m["peak"]
                        tag = f"linear_{name}_int{bits}_T{T}_{nt}t"
                        print(f"{tag}_time: {sec * 1e3:.3f} ms")
                        print(f"{tag}_cpu_share: {m['cpu_share']:.2f} of wall time x threads")
                        print(f"{tag}_read_bandwidth: {bw / 1e9:.2f} GB/s (probe, {nt} thread(s), best of 4 bracketing)")
                        print(f"{tag}_weight_read: {nbytes / sec / 1e9:.2f} GB/s")
                        print(f"{tag}_bw_fraction: {nbytes / sec / bw:.3f} of measured read bandwidth")
                        if T >= 64:
                            print(f"{tag}_int8_peak: {peak / 1e9:.1f} GOP/s (probe, best of 4 bracketing)")
                            print(f"{tag}_compute: {2 * macs / sec / 1e9:.1f} GOP/s")
                            print(f"{tag}_peak_fraction: {2 * macs / sec / peak:.3f} of measured int8 vpdpbusd peak")
                        if torch_mm:
                            print(f"{tag}_torch_f32_time: {sec_torch * 1e3:.3f} ms")
                            print(f"{tag}_vs_torch_f32: {sec_torch / sec:.2f} x (torch float32 matmul time / kernel)")
            weights = w32 = None   # free before the next shape's
    if not args.no_repack:
        for nt in args.threads:
            with LinearKernels(n_threads=nt, backend=args.backend) as lin:
                bench_repack(lin, nt, rng)


if __name__ == "__main__":
    main()
