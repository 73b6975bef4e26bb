"""Quantized GPU Linears at decode (M = 1 token): dense matmul vs packed Marlin weights, per ktrun.ops.packed_linear.

For DeepSeek-V3's non-expert Linear shapes, times one y = x W^T with
  dense          W dequantized once (what `--gpu-weights dequant` runs),
  per_call       W kept packed (int4, group 128) and dequantized for each call (`packed` without a kernel),
  marlin         the installed Marlin GEMM reading the packed weight in place (CUDA with vLLM or SGLang only),
  triton         ktrun's own Triton W4A16 kernel on the GPTQ layout (ktrun.ops.triton_linear; CUDA with torch alone),
                 at M = 1, 4 and 16 decode rows, its output checked against the dense matmul,
and reports each path's effective weight-read bandwidth against the device read bandwidth measured in the same run.
Prints `name: value unit` lines; what was not measured on this machine (no CUDA, no kernel) is said, not printed.

    .venv/bin/python bench/bench_gpu_linear.py [--device cpu|cuda] [--reps 20]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from ktlayouts.gptq import GptqGeometry
from ktlayouts.marlin import marlin_pack
from ktrun.ops.marlin import find_marlin_kernel
from ktrun.ops.packed_linear import MarlinLinear
from ktrun.ops.triton_linear import TritonLinear, triton_missing

TRITON_ROWS = (1, 4, 16)

# (name, N, K): DeepSeek-V3 q_a_proj, kv_a_proj_with_mqa (576 = 512 + 64), shared-expert gate, down, o_proj
SHAPES = [("q_a", 1536, 7168), ("kv_a", 576, 7168), ("shared_gate", 2048, 7168), ("shared_down", 7168, 2048),
          ("o_proj", 7168, 16384)]
GROUP = 128


def sync(dev: torch.device):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def best_ms(dev, reps: int, fn, *args) -> float:
    fn(*args)
    sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        sync(dev)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def read_bandwidth(dev: torch.device, reps: int) -> float:
    """GB/s read by a sum over a 512 MiB float32 tensor (a read-only pass, all of torch's threads / SMs)."""
    a = torch.ones(128 << 20, dtype=torch.float32, device=dev)
    ms = best_ms(dev, max(3, reps // 4), torch.sum, a)
    return a.numel() * 4 / ms / 1e6


def packed_layer(n: int, k: int, dev, dtype, kernel) -> MarlinLinear:
    rng = np.random.default_rng(0)
    geom = GptqGeometry(n, k, 4, GROUP)
    t = marlin_pack(rng.integers(0, 16, (k, n), dtype=np.uint8),
                    (rng.random(geom.scales_shape) * 1e-2).astype(np.float16), geom)
    return MarlinLinear("bench", torch.from_numpy(t["qweight"]).to(dev), torch.from_numpy(t["scales"]).to(dev), 4,
                        n, k, dtype, kernel=kernel)


def bench_shape(tag: str, n: int, k: int, dev, dtype, kernel, bw: float, reps: int):
    layer = packed_layer(n, k, dev, dtype, None)
    w = layer.dequantize(dtype)
    x = torch.randn(1, k, device=dev, dtype=dtype)                  # x: (1, K), one decode token
    dense_ms = best_ms(dev, reps, torch.nn.functional.linear, x, w)
    per_call_ms = best_ms(dev, max(3, reps // 4), layer, x)
    print(f"{tag}_dense_ms: {dense_ms:.3f} ms")
    print(f"{tag}_dense_bw_fraction: {w.numel() * w.element_size() / dense_ms / 1e6 / bw:.3f} of read bandwidth")
    print(f"{tag}_per_call_dequant_ms: {per_call_ms:.3f} ms")
    print(f"{tag}_per_call_vs_dense: {per_call_ms / dense_ms:.1f} x")
    if kernel is not None:
        fast = packed_layer(n, k, dev, dtype, kernel)
        marlin_ms = best_ms(dev, reps, fast, x)
        print(f"{tag}_marlin_ms: {marlin_ms:.4f} ms")
        print(f"{tag}_marlin_speedup_vs_dense: {dense_ms / marlin_ms:.2f} x")
        print(f"{tag}_marlin_bw_fraction: {fast.nbytes / marlin_ms / 1e6 / bw:.3f} of read bandwidth")
    if dev.type == "cuda" and triton_missing() is None:
        tri = TritonLinear.from_marlin(layer)
        for m in TRITON_ROWS:
            xm = torch.randn(m, k, device=dev, dtype=dtype)
            dense_m = best_ms(dev, reps, torch.nn.functional.linear, xm, w)
            tri_ms = best_ms(dev, reps, tri, xm)
            want = torch.nn.functional.linear(xm.float(), w.float())
            err = ((tri(xm).float() - want).abs().max() / want.abs().max()).item()
            print(f"{tag}_triton_m{m}_ms: {tri_ms:.4f} ms")
            print(f"{tag}_triton_m{m}_speedup_vs_dense: {dense_m / tri_ms:.2f} x")
            print(f"{tag}_triton_m{m}_bw_fraction: {tri.nbytes / tri_ms / 1e6 / bw:.3f} of read bandwidth")
            print(f"{tag}_triton_m{m}_max_rel_err: {err:.2e} ratio")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kernel = find_marlin_kernel(dev)
    bw = read_bandwidth(dev, args.reps)
    print(f"device_read_bandwidth: {bw:.1f} GB/s")
    if kernel is None:
        print(f"# no Marlin kernel on {dev.type} (vLLM / SGLang on CUDA): marlin lines not measured")
    if dev.type != "cuda" or triton_missing() is not None:
        print(f"# ktrun's Triton kernel needs CUDA ({triton_missing() or dev.type}): triton lines not measured "
              "(tests/test_triton_linear.py checks its numerics on the CPU under Triton's interpreter)")
    for name, n, k in SHAPES:
        bench_shape(f"gpu_linear_{name}_{n}x{k}", n, k, dev, dtype, kernel, bw, args.reps)

if __name__ == "__main__":
    main()
