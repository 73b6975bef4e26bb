"""ktrun.ops.prompt_attention: a prompt's causal attention on libktkernels (kt_prompt_attend) on the kernel pool:
GQA / MQA / MHA heads, a chunk after a cached prefix, sliding windows, sinks, and MLA's expanded keys (a per-head
part and the roped part every head shares, never materialized per head).

Why not torch's scaled_dot_product_attention: on 2 Zen 4 cores it ran Qwen3-30B-A3B's 32 / 4 heads of 128 at 63-78
GFLOP/s of causal work for a 512-token prompt (0.4 of what a GEMM reaches there; 20% of the prefill), woke torch's
OpenMP team beside the kernel pool, and needs a materialized mask for a chunk after a prefix or a window (and has no
sinks). The kernel's numerics are its own (kernels/src/prompt_attend.cpp): one fixed order per output, the same bits
on every ISA and thread count; within float32 rounding of torch's.

    from ktrun.ops import prompt_attention
    ok = prompt_attention.attend(q, k, v, start, scale, out, kernels=kernels)   # False: not taken, out untouched
    # q (n, nh, dk), k (S, nkv, dk1), v (S, nkv, dv), out (n, nh, dv): float32 CPU, rows start .. start + n - 1
"""
from __future__ import annotations

import ctypes

import torch

from .library import KernelError, PromptAttendArgs, kernels_available, load_library

_lib: list = []   # the library, loaded once (None: not on this machine)


def _library():
    if not _lib:
        _lib.append(load_library() if kernels_available() else None)
    return _lib[0]


def _rows(t: torch.Tensor, width: int) -> bool:
    """A float32 CPU (rows, heads, width) view with contiguous elements per head."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 3 and t.shape[-1] == width and \
        (t.stride(2) == 1 or width == 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, out: torch.Tensor,
           window: int | None = None, sinks: torch.Tensor | None = None, k2: torch.Tensor | None = None,
           kernels=None) -> bool:
    """out[t, h] = softmax over the positions j row t sees (j <= start + t, within window) of (q[t, h] . key_j *
    scale), times v_j: q (n, nh, dk); keys k (S, nkv, dk1) for positions 0 .. S - 1 (S >= start + n), followed by
    k2 (S, nkv or 1, dk - dk1) when given (1: one part every head shares); v (S, nkv, dv); out (n, nh, dv); sinks
    (nh,) float32 logits in each softmax's denominator. kernels: a MoEKernels / LinearKernels context whose pool
    runs it (None: the calling thread). False (nothing done) when the library or the tensors do not fit."""
    lib = _library()
    if lib is None:
        return False
    n, nh, dk = q.shape
    S, nkv, dk1 = k.shape
    dv = v.shape[-1]
    if not (_rows(q, dk) and _rows(k, dk1) and _rows(v, dv) and _rows(out, dv)) or out.shape[:2] != (n, nh) or \
            v.shape[:2] != (S, nkv) or S < start + n or nh % nkv or dv % 16 or (k2 is None) != (dk1 == dk):
        return False
    if k2 is not None and not (_rows(k2, dk - dk1) and k2.shape[0] == S and k2.shape[1] in (1, nkv)):
        return False
    if sinks is not None and not (sinks.dtype == torch.float32 and sinks.device.type == "cpu" and
                                  sinks.shape == (nh,) and sinks.is_contiguous()):
        return False
    a = PromptAttendArgs(n=n, nh=nh, nkv=nkv, dk=dk, dk1=dk1, dv=dv, start=start, window=window or 0,
                         q=q.data_ptr(), q_row=q.stride(0), q_head=q.stride(1),
                         k=k.data_ptr(), k_row=k.stride(0), k_head=k.stride(1),
                         v=v.data_ptr(), v_row=v.stride(0), v_head=v.stride(1),
                         sinks=None if sinks is None else sinks.data_ptr(), scale=scale,
                         out=out.data_ptr(), out_row=out.stride(0), out_head=out.stride(1))
    if k2 is not None:
        a.k2, a.k2_row, a.k2_head = k2.data_ptr(), k2.stride(0), 0 if k2.shape[1] == 1 else k2.stride(1)
    if lib.kt_prompt_attend(None if kernels is None else kernels.handle, ctypes.byref(a)) != 0:
        raise KernelError(f"{lib.kt_last_error().decode()} (q {tuple(q.shape)}, k {tuple(k.shape)}, "
                          f"v {tuple(v.shape)}, start {start})")
    return True
