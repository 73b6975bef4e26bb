"""ktrun.ops.float_linear: the output head of a CPU forward, y = x W^T with W float32 or bfloat16 as stored, on
libktkernels (kt_float_linear) on the kernel pool.

Why not torch: the loader widened the checkpoint's bf16 head to a float32 copy (twice the bytes read every step:
DeepSeek-V3's 129280 x 7168 head is 1.85 GB stored, 3.7 GB widened), and an MKL GEMM woke torch's OpenMP team beside
the kernel pool (the default model's head at 16 decode rows: ~0.96 ms inside a step, ~0.38 ms alone). The kernel
reads the stored bf16 and widens it in registers (exactly), and sums each logit in one fixed order (float_dots',
kernels/src/mla_attend_body.inc): a row's logits are the same bits whatever the batch, T, thread count or ISA.

    from ktrun.ops import float_linear
    float_linear.takes(w)                             # True: w (N, K) float32 / bf16 on the CPU, K % 16 == 0
    logits = float_linear.head(h, w, kernels)         # h (T, K) -> (T, N) float32; torch's linear when not taken
"""
from __future__ import annotations

import torch

from .library import KernelError, kernels_available, load_library
from .packed_linear import linear

DTYPES = {torch.float32: 0, torch.bfloat16: 1}   # ktkernels.h KT_F32 / KT_BF16


_available: list[bool] = []   # kernels_available(), asked once (a missing library would be looked for every call)


def available() -> bool:
    """Whether libktkernels loads (the loader keeps a bf16 head as stored only then)."""
    if not _available:
        _available.append(kernels_available())
    return _available[0]


def takes(w) -> bool:
    """Whether kt_float_linear computes with weight w: a CPU (N, K) float32 / bfloat16 tensor with contiguous rows,
    K a multiple of 16, the library loaded."""
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in DTYPES and w.device.type == "cpu"
            and w.shape[1] % 16 == 0 and w.stride(1) == 1 and w.stride(0) >= w.shape[1] and available())


def float_linear(x: torch.Tensor, w: torch.Tensor, kernels=None) -> torch.Tensor:
    """x (T, K) (widened to float32) times w (N, K) transposed -> (T, N) float32, on the pool of kernels (a
    ktrun.ops.moe.MoEKernels; None: the calling thread)."""
    x = x.float().contiguous()
    T, K = x.shape
    N = w.shape[0]
    y = torch.empty((T, N), dtype=torch.float32)
    if load_library().kt_float_linear(None if kernels is None else kernels.handle, T, N, K, x.data_ptr(), K,
                                      w.data_ptr(), DTYPES[w.dtype], w.stride(0), y.data_ptr(), N) != 0:
        raise KernelError(f"kt_float_linear: bad arguments (x {tuple(x.shape)}, w {tuple(w.shape)} {w.dtype})")
    return y


def head(h: torch.Tensor, w, kernels=None) -> torch.Tensor:
    """The output head: h (T, K) -> float32 logits (T, N), on kt_float_linear when it takes w and h is on the CPU,
    else torch's (or a packed head's) linear."""
    if h.device.type == "cpu" and h.dim() == 2 and takes(w) and h.shape[1] == w.shape[1]:
        return float_linear(h, w, kernels)
    if isinstance(w, torch.Tensor) and w.dtype != h.dtype:   # a head kept as stored, on rows it does not take
        w = w.to(h.dtype)
    return linear(h, w).float()
