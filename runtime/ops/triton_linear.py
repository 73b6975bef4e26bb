"""A GPU Linear y = x W^T run by ktrun's own Triton W4A16 / W8A16 kernel on the GPTQ layout (ktlayouts.gptq), so a
CUDA box with torch alone (Triton ships with CUDA torch) reads 4 or 8 bits per weight, not 16, without vLLM/SGLang.

Layout read in place (built once at load, from any registered GPU format or from a Marlin layer on the device):
    qweight (K_s*bits/32, N_s) int32   codes packed along K, 32/bits per word, least significant bits first
    scales  (n_groups, N_s) float16    W[n, k] = (code[k, n] - 2^(bits-1)) * scales[g_idx[k], n]
    g_idx   (K_s,) int32 or None       act-order GPTQ's permuted groups; None: k // G
K_s, N_s are the stored (possibly zero-padded) sizes; the logical Linear is (N, K) <= (N_s, K_s).

The kernel (one for every M): programs tile (BLOCK_M rows of x) x (BLOCK_N outputs) and walk K in blocks of
BLOCK_K, split over SPLIT_K programs when the (M, N) tiles alone would leave the GPU idle (decode: M = 1..16 rows
is a split-K GEMV that streams the weights; prefill: a tiled GEMM). Without act order a K block lies in one group,
so the block's integer codes (exact in bf16/fp16) meet x in one tl.dot and the group's scale multiplies the float32
partial sum: the products are exact and only the sums round. With act order the codes are scaled per row first.
Split-K partial sums go to a float32 (SPLIT_K, M, N) buffer summed by torch in a fixed order (deterministic).

With TRITON_INTERPRET=1 in the environment when Triton is imported, the same kernel runs on CPU tensors under
Triton's interpreter (no GPU needed: the tests run it so, in a subprocess). Triton 3.9's
interpreter computes a bfloat16 tl.dot wrongly (numpy has no bfloat16), so interpreted dots take float32 operands:
the values are those the GPU multiplies (bf16/fp16 inputs and small integer codes are exact in float32).

KTRUN_TRITON=auto (default: used on CUDA when no Marlin GEMM is installed), on (preferred even over Marlin; on the
CPU device too when TRITON_INTERPRET=1), off.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from ktlayouts.gptq import pack_rows, zero_point

try:   # Triton comes with CUDA torch (and here with xgrammar); without it the layers use the other paths
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

TRITON_CHOICES = ("auto", "on", "off")
DECODE_ROWS = 16                 # M up to this is a split-K GEMV (tl.dot needs 16 rows: fewer are masked)
BLOCK_N = 64
MAX_BLOCK_K = 128


def triton_choice() -> str:
    choice = os.environ.get("KTRUN_TRITON", "auto").lower()
    if choice not in TRITON_CHOICES:
        raise ValueError(f"KTRUN_TRITON={choice!r}: expected one of {', '.join(TRITON_CHOICES)}")
    return choice


def triton_missing() -> str | None:
    """Why Triton cannot run here (None when it can)."""
    return "triton is not installed" if triton is None else None


def use_triton(device: torch.device, marlin_found: bool) -> bool:
    """Whether packed GPU Linears on `device` run the Triton kernel (see the module docstring for KTRUN_TRITON)."""
    choice = triton_choice()
    if choice == "off" or triton_missing() is not None:
        return False
    if device.type != "cuda":
        return choice == "on" and interpreting()
    return choice == "on" or not marlin_found


# --- the kernel ------------------------------------------------------------------------------------------------

def _wna16_body(x_ptr, qw_ptr, s_ptr, g_ptr, out_ptr, M, N, K, stride_xm, stride_qk, stride_sg, stride_os,
                stride_om, GROUP, BITS: tl.constexpr, HAS_GIDX: tl.constexpr, DOT_F32: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # x: (M, K) bf16/fp16/fp32; qw: (K/PF, N) int32; s: (G, N) fp16; g: (K,) int32; out: (SPLIT_K, M, N) fp32
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    ZP: tl.constexpr = 1 << (BITS - 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=in_m[:, None] & in_k[None, :],
                    other=0.0)                                                           # (BM, BK)
        words = tl.load(qw_ptr + (offs_k // PF)[:, None] * stride_qk + offs_n[None, :],
                        mask=in_k[:, None] & in_n[None, :], other=0)                     # (BK, BN) int32
        q = ((words >> ((offs_k % PF) * BITS)[:, None]) & MASK) - ZP                     # signed codes
        if HAS_GIDX:      # act order: each K row has its own group; scale the codes before the dot
            g = tl.load(g_ptr + offs_k, mask=in_k, other=0)
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=in_k[:, None] & in_n[None, :],
                        other=0.0).to(tl.float32)
            w = q.to(tl.float32) * s
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        else:             # the block lies in group kb*BLOCK_K // GROUP: scale the block's partial sum
            s = tl.load(s_ptr + ((kb * BLOCK_K) // GROUP) * stride_sg + offs_n, mask=in_n, other=0.0).to(tl.float32)
            if DOT_F32:
                part = tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x, q.to(x.dtype))
            acc += part * s[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc, mask=in_m[:, None] & in_n[None, :])


def interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1, read by Triton when it is imported): kernels run on CPU tensors."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


_wna16 = triton.jit(_wna16_body) if triton is not None else None


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int


def launch_config(m: int, n: int, k: int, group: int, act_order: bool, device: torch.device,
                  split_k: int | None = None) -> LaunchConfig:
    """Tile sizes for one call. BLOCK_K divides the group (so a K block has one scale); decode rows are split over K
    until the grid covers the SMs about four times; split_k overrides (tests)."""
    block_m = 16 if m <= DECODE_ROWS else 32 if m <= 32 else 64
    block_k = 64 if act_order else min(MAX_BLOCK_K, group)
    k_blocks = -(-k // block_k)
    tiles = -(-m // block_m) * -(-n // BLOCK_N)
    if split_k is None:
        split_k = 1 if m > DECODE_ROWS else max(1, min(k_blocks, -(-4 * _sm_count(device) // tiles)))
    return LaunchConfig(block_m, BLOCK_N, block_k, max(1, min(int(split_k), k_blocks)))


def wna16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                 bits: int, group: int, split_k: int | None = None) -> torch.Tensor:
    """x (M, K_s) bf16/fp16/fp32 -> x W^T (M, N_s) float32; W from qweight/scales/g_idx (module docstring)."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 32 // bits != k:
        raise ValueError(f"x has K={k}, qweight {tuple(qweight.shape)} holds K={qweight.shape[0] * 32 // bits}")
    if m == 0:
        return torch.zeros((0, n), dtype=torch.float32, device=x.device)
    x = x.contiguous()
    cfg = launch_config(m, n, k, group, g_idx is not None, x.device, split_k)
    out = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"the Triton kernel needs a CUDA device, or TRITON_INTERPRET=1 for {x.device} tensors")
    grid = (-(-m // cfg.block_m), -(-n // cfg.block_n), cfg.split_k)
    _wna16[grid](
        x, qweight, scales, qweight if g_idx is None else g_idx, out, m, n, k, x.stride(0), qweight.stride(0),
        scales.stride(0), out.stride(0), out.stride(1), group, BITS=bits, HAS_GIDX=g_idx is not None,
        DOT_F32=interpreting() or x.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k)
    return out[0] if cfg.split_k == 1 else out.sum(0)


# --- the Linear ------------------------------------------------------------------------------------------------

def pack_rows_torch(codes_kn: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (K, N) uint8 -> (K*bits/32, N) int32 packed along K, least significant bits first (the torch twin of
    ktlayouts.gptq.pack_rows, run on the device for layers already there)."""
    pf = 32 // bits
    k, n = codes_kn.shape
    shifts = (torch.arange(pf, device=codes_kn.device, dtype=torch.int64) * bits).view(1, pf, 1)
    words = (codes_kn.to(torch.int64).view(k // pf, pf, n) << shifts).sum(1)        # (K/PF, N) in [0, 2^32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class TritonLinear:
    """One quantized Linear y = x W^T (+ b), W (N, K), packed on `device` as the module docstring says."""

    def __init__(self, name: str, qweight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                 bits: int, group_size: int, n: int, k: int, dtype: torch.dtype):
        self.name, self.bits, self.n, self.k, self.dtype = name, bits, n, k, dtype
        self.qweight, self.scales, self.g_idx = qweight, scales, g_idx
        self.k_pad, self.n_pad = qweight.shape[0] * 32 // bits, qweight.shape[1]
        self.group_size = group_size
        self.group = self.k_pad if group_size == -1 else group_size
        if scales.shape != (self.k_pad // self.group, self.n_pad):
            raise ValueError(f"{name}: scales {tuple(scales.shape)} do not fit qweight {tuple(qweight.shape)} "
                             f"at {bits} bits, group {group_size}")

    @classmethod
    def from_unpacked(cls, name: str, u, bits: int, device, dtype: torch.dtype) -> TritonLinear:
        """From a ktlayouts.gpu_formats.UnpackedLinear (any registered format, unpacked on the host at load)."""
        g_idx = None if np.array_equal(u.g_idx, u.geom.default_g_idx()) else torch.from_numpy(
            np.ascontiguousarray(u.g_idx, dtype=np.int32)).to(device)
        n, k = u.shape
        return cls(name, torch.from_numpy(pack_rows(u.codes_kn, bits)).to(device),
                   torch.from_numpy(np.ascontiguousarray(u.scales_gn, dtype=np.float16)).to(device), g_idx, bits,
                   u.geom.group_size, n, k, dtype)

    @classmethod
    def from_marlin(cls, layer) -> TritonLinear:
        """From a ktrun.ops.packed_linear.MarlinLinear, repacked with torch on its device (its memory is then free)."""
        from ktlayouts.marlin import grouped_scales

        from .packed_linear import marlin_codes, marlin_scales
        codes = marlin_codes(layer.qweight, layer.bits)                                  # (K_pad, N_pad) uint8
        scales = marlin_scales(layer.scales.to(torch.float16), grouped_scales(layer.k_pad, layer.group_size))
        return cls(layer.name, pack_rows_torch(codes, layer.bits), scales.contiguous(), None, layer.bits,
                   layer.group_size, layer.n, layer.k, layer.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        g = 0 if self.g_idx is None else self.g_idx.numel() * 4
        return self.qweight.numel() * 4 + self.scales.numel() * self.scales.element_size() + g

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> W (N, K) on the layer's device (for weights used other than as a matmul, and tests)."""
        pf = 32 // self.bits
        shifts = torch.arange(pf, device=self.qweight.device, dtype=torch.int32) * self.bits
        codes = ((self.qweight[:, None, :] >> shifts[None, :, None]) & ((1 << self.bits) - 1)).reshape(self.k_pad, -1)
        g = self.g_idx if self.g_idx is not None else torch.arange(self.k_pad, device=codes.device) // self.group
        w = (codes.float() - zero_point(self.bits)) * self.scales.float()[g]
        return w[: self.k, : self.n].t().to(dtype or self.dtype).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., K) -> (..., N) in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if self.k_pad != self.k:
            x2 = F.pad(x2, (0, self.k_pad - self.k))
        y = wna16_matmul(x2, self.qweight, self.scales, self.g_idx, self.bits, self.group)[:, : self.n]
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*lead, self.n)
