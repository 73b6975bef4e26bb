"""Benchmark: MLA's absorbed kv_b at decode (T = 1), DeepSeek-V3's shapes (128 heads, nope 128, v 128, kv_lora 512),
on the quantized Linear op (ktrun.ops.kernel_linear.AbsorbedKvB: W_uk's transposed codes + W_uv on kv_b's tiles, two
grouped submits) against the float32 pair it replaced (W_uk^T (nh, R, dn) and W_uv (nh, dv, R), torch batched
matrix-vector products, the fast orientations).

Each side cycles over --copies copies of one layer's weights (so they are read from memory, not from L3). Rounds of
(read-bandwidth probe, op block, float32 block), closed by a probe; best of each over the rounds, so both and the
limit are sampled in the same stretches of time on this shared machine. Output: `name: value unit` lines: time per
layer (q_latent + values), bytes read, GB/s and that over the read bandwidth measured in the same run.

    .venv/bin/python bench/bench_mla_absorbed.py                 # int4 and int8, g128, 2 threads (~1 minute)
    .venv/bin/python bench/bench_mla_absorbed.py --bits 4 --copies 4
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # torch's idle OpenMP threads must not spin on the pool's CPUs

import numpy as np
import torch
from ktlayouts.cpu_linear import linear_geometry, pack_linear_codes
from ktrun.ops.kernel_linear import AbsorbedKvB, KernelLinear
from ktrun.ops.linear import LinearKernels

NH, DN, DV, R = 128, 128, 128, 512


def layer(lin: LinearKernels, rng, bits: int, group: int) -> AbsorbedKvB:
    """One random kv_b_proj (nh*(dn+dv), R) registered on the op as the loader does, in its absorbed form."""
    n = NH * (DN + DV)
    geom = linear_geometry(n, R, bits, group)
    codes = rng.integers(0, 1 << bits, size=(n, R), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-2, size=(n, R // group)).astype(np.float32)
    qw, sc = pack_linear_codes(codes, scales, geom)
    lid = lin.n_linears
    lin.add(lid, qw, sc, n, R, bits, group)
    return AbsorbedKvB(KernelLinear("kv_b_proj.weight", lin, lid, n, R, R, geom, qw, sc, torch.float32), NH, DN, DV, R)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copies", type=int, default=6, help="layers cycled over (weights read from memory)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    q = torch.randn(1, NH, DN)
    lat = torch.randn(1, NH, R)
    f32 = [(torch.randn(NH, R, DN), torch.randn(NH, DV, R)) for _ in range(args.copies)]
    f32_bytes = sum(t.numel() * 4 for t in f32[0])

    def run_f32(i: int) -> None:
        w_uk_t, w_uv = f32[i % len(f32)]
        torch.matmul(w_uk_t, q.permute(1, 2, 0))
        torch.matmul(w_uv, lat.permute(1, 2, 0))

    with LinearKernels(n_threads=args.threads) as lin:
        for bits in args.bits:
            layers = [layer(lin, rng, bits, args.group) for _ in range(args.copies)]

            def run_op(i: int, layers=layers) -> None:
                ab = layers[i % len(layers)]
                ab.q_latent(q)
                ab.values(lat)

            best = {"op": float("inf"), "f32": float("inf"), "bw": 0.0}
            for r in range(args.rounds + 1):
                best["bw"] = max(best["bw"], lin.kernels.measure_read_bandwidth(512 << 20, 4))
                if r == args.rounds:
                    break
                for name, fn in (("op", run_op), ("f32", run_f32)):
                    fn(0)
                    for i in range(args.reps):
                        t0 = time.perf_counter()
                        fn(i + 1)
                        best[name] = min(best[name], time.perf_counter() - t0)
            op_bytes = layers[0].nbytes
            tag = f"absorbed_kv_b_int{bits}_g{args.group}_t1_{args.threads}thr"
            print(f"{tag}_op_time: {best['op'] * 1e6:.1f} us")
            print(f"{tag}_op_bytes: {op_bytes / 1e6:.2f} MB")
            print(f"{tag}_op_read: {op_bytes / best['op'] / 1e9:.2f} GB/s")
            print(f"{tag}_op_over_bandwidth: {op_bytes / best['op'] / best['bw']:.3f} ratio")
            print(f"{tag}_float32_time: {best['f32'] * 1e6:.1f} us")
            print(f"{tag}_float32_bytes: {f32_bytes / 1e6:.2f} MB")
            print(f"{tag}_float32_over_op: {best['f32'] / best['op']:.2f} ratio")
            print(f"read_bandwidth_measured: {best['bw'] / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
