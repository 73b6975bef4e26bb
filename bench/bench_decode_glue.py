"""Benchmark: the decode step's float kernels outside the quantized Linears, on libktkernels' pool: the output head on
its stored bf16 weights (kt_float_linear), MLA's absorbed attention core (kt_mla_attend_batch: DeepSeek-V3's 128 heads,
kv_lora 512, rope 64) and GQA attention (kt_gqa_attend_batch: Qwen3-30B-A3B's 32 query / 4 KV heads of 128), one
decode row at a few cache lengths.

Each is timed against what bounds it, measured in the same run: the head (weights read from memory: --head-rows x
7168 bf16, larger than L3) against the pool's read bandwidth (kt_measure_read_bandwidth), the attention (cache rows
hot in cache after the first call) against torch's float32 form of the same math on the same threads (two batched
matrix products and a softmax: what the kernels replaced). Rounds of (probe, kernel, torch), best of each. Output:
`name: value unit` lines. The ISA copy is the kernels' backend (KT_KERNEL_BACKEND=avx2 runs the AVX2 copy on an
AVX-512 host; the glue follows the process-wide choice).

    .venv/bin/python bench/bench_decode_glue.py                        # 2 threads (~1 minute)
    KT_KERNEL_BACKEND=scalar .venv/bin/python bench/bench_decode_glue.py --threads 1 --head-rows 8192
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # torch's idle OpenMP threads must not spin on the pool's CPUs

import torch
from ktrun.ops import glue
from ktrun.ops.float_linear import float_linear
from ktrun.ops.moe import MoEKernels

HIDDEN = 7168
MLA = {"nh": 128, "R": 512, "dr": 64}   # DeepSeek-V3's absorbed attention: q_lat (nh, R), q_rot (nh, dr), rows R + dr
GQA = {"nh": 32, "nkv": 4, "hd": 128}   # Qwen3-30B-A3B


def best_of(fn, reps: int) -> float:
    """Seconds of the fastest of reps calls (one warm-up call first)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def head_case(moe: MoEKernels, rows: int, tokens: int, rounds: int) -> None:
    # w: (rows, 7168) bf16, cycled over copies so each call reads from memory
    copies = max(1, -(-(64 << 20) // (rows * HIDDEN * 2)))
    ws = [torch.randn(rows, HIDDEN).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(tokens, HIDDEN)
    turn = [0]

    def call():
        float_linear(x, ws[turn[0] % copies], moe)
        turn[0] += 1

    sec, bw = float("inf"), 0.0
    for _ in range(rounds):
        bw = max(bw, moe.measure_read_bandwidth(512 << 20, 3))
        sec = min(sec, best_of(call, 5))
    nbytes = rows * HIDDEN * 2
    tag = f"head_bf16_{rows}x{HIDDEN}_T{tokens}"
    print(f"{tag}_time: {sec * 1e3:.3f} ms")
    print(f"{tag}_weight_read: {nbytes / sec / 1e9:.2f} GB/s")
    print(f"{tag}_read_bandwidth: {bw / 1e9:.2f} GB/s (probe, best of the rounds)")
    print(f"{tag}_bw_fraction: {nbytes / sec / bw:.3f} of measured read bandwidth")


def mla_case(moe: MoEKernels, S: int, rounds: int) -> None:
    nh, R, dr = MLA["nh"], MLA["R"], MLA["dr"]
    q_lat, q_rot = torch.randn(1, nh, R), torch.randn(1, nh, dr)
    cache = torch.randn(S, R + dr)          # (S, R + dr): [c_j | k_rot_j] per position
    out = torch.empty(1, nh, R)
    scale = 0.07

    def kernel():
        glue.mla_attend_batch(q_lat, q_rot, [[cache]], scale, out, moe)

    def reference():   # torch's float32 form: scores (nh, S), softmax, (nh, S) x (S, R)
        s = (q_lat[0] @ cache[:, :R].T + q_rot[0] @ cache[:, R:].T) * scale
        torch.softmax(s, dim=-1) @ cache[:, :R]

    report(f"mla_attend_{nh}h_S{S}", kernel, reference, 2 * nh * S * (R + dr) + 2 * nh * S * R, rounds)


def gqa_case(moe: MoEKernels, S: int, rounds: int) -> None:
    nh, nkv, hd = GQA["nh"], GQA["nkv"], GQA["hd"]
    q = torch.randn(1, nh, hd)
    k, v = torch.randn(S, nkv, hd), torch.randn(S, nkv, hd)
    out = torch.empty(1, nh, hd)
    scale = hd ** -0.5
    qg = q[0].view(nkv, nh // nkv, hd)     # (nkv, rep, hd)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)   # (nkv, S, hd)

    def kernel():
        glue.gqa_attend_batch(q, [[(k, v)]], scale, out, moe)

    def reference():
        torch.softmax(qg @ kt.transpose(1, 2) * scale, dim=-1) @ vt

    report(f"gqa_attend_{nh}q{nkv}kv_S{S}", kernel, reference, 4 * nh * S * hd, rounds)


def report(tag: str, kernel, reference, flops: int, rounds: int) -> None:
    sec = ref = float("inf")
    for _ in range(rounds):
        sec = min(sec, best_of(kernel, 20))
        ref = min(ref, best_of(reference, 20))
    print(f"{tag}_time: {sec * 1e3:.3f} ms")
    print(f"{tag}_compute: {flops / sec / 1e9:.1f} GFLOP/s")
    print(f"{tag}_torch_f32_time: {ref * 1e3:.3f} ms")
    print(f"{tag}_vs_torch_f32: {ref / sec:.2f} x (torch float32 time / kernel)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head-rows", type=int, default=32768, help="rows of the bf16 head (DeepSeek-V3's: 129280)")
    ap.add_argument("--head-tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--positions", type=int, nargs="+", default=[64, 512, 4096], help="cache lengths S")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    with MoEKernels(n_threads=args.threads) as moe:
        print(f"backend: {moe.backend_detail} (KT_KERNEL_BACKEND={os.environ.get('KT_KERNEL_BACKEND', 'unset')}), "
              f"{args.threads} thread(s), torch {torch.get_num_threads()} thread(s)")
        for T in args.head_tokens:
            head_case(moe, args.head_rows, T, args.rounds)
        for S in args.positions:
            mla_case(moe, S, args.rounds)
        for S in args.positions:
            gqa_case(moe, S, args.rounds)


if __name__ == "__main__":
    main()
