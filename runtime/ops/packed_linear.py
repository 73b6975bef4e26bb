"""A GPU Linear kept in the Marlin layout (ktlayouts.marlin) on the compute device, never repacked at load.

Forward, in order of preference:
  1. an installed Marlin W4A16 / W8A16 GEMM (ktrun.ops.marlin: vLLM's or SGLang's `apply_gptq_marlin_linear`)
     reads qweight and the permuted scales in place: 4 or 8 bits per weight cross the memory bus, not 16;
  2. otherwise the layer dequantizes itself on its device for the call (torch ops that undo the Marlin
     permutations; the same arithmetic as ktlayouts' numpy reference, float32) and runs a dense matmul; the
     dense copy lives only for that call, so device memory stays that of the packed weights plus one layer.

Shapes: qweight (K_pad/16, N_pad*16*bits/32) int32; scales (n_groups, N_pad) in Marlin column order;
the Linear is (N, K) = weight_shape, zero padded by the converter up to (N_pad, K_pad) (layouts/README.md, "Marlin padding").
"""
from __future__ import annotations

from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from ktlayouts.gptq import group_size_for, zero_point
from ktlayouts.marlin import MARLIN_TILE, grouped_scales, qweight_kn, scale_perms, weight_perm


@cache
def _inverse_perms(bits: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors that undo the weight permutation (1024 values) and the two scale permutations (64 / 32)."""
    grouped, single = scale_perms()
    return tuple(torch.from_numpy(np.argsort(p)).to(device) for p in (weight_perm(bits), grouped, single))


def unpack_cols(qw: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C) int32 -> (R, C*32/bits) uint8 codes, least significant bits first. The int32 words are little-endian
    bytes, so this is a byte view (8 bits), or each byte's low then high nibble (4 bits)."""
    b = qw.contiguous().view(torch.uint8)                             # (R, 4C)
    if bits == 8:
        return b
    return torch.stack((b & 15, b >> 4), dim=-1).reshape(qw.shape[0], -1)


def marlin_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """qweight (K/16, N*16*bits/32) int32 -> codes (K, N) uint8 (the inverse of ktlayouts.marlin.pack_weight)."""
    t = unpack_cols(qweight, bits)                          # (K/16, 16 N): 16x16 tiles, fragment order
    k, n = qweight_kn(qweight.shape, bits)
    inv, _, _ = _inverse_perms(bits, str(qweight.device))
    t = t.reshape(-1, inv.numel())[:, inv]                  # back to four row-major 16x16 tiles per 1024 values
    tile = MARLIN_TILE
    return t.reshape(k // tile, n // tile, tile, tile).transpose(1, 2).reshape(k, n)


def marlin_scales(scales: torch.Tensor, grouped: bool) -> torch.Tensor:
    """scales (n_groups, N) in Marlin column order -> natural order (the inverse of ktlayouts.marlin.pack_scales)."""
    _, inv_grouped, inv_single = _inverse_perms(4, str(scales.device))
    inv = inv_grouped if grouped else inv_single
    return scales.reshape(-1, inv.numel())[:, inv].reshape(scales.shape)


class MarlinLinear:
    """One quantized Linear y = x W^T (+ b), W (N, K), stored in the Marlin layout on `device`."""

    def __init__(self, name: str, qweight: torch.Tensor, scales: torch.Tensor, bits: int, n: int, k: int,
                 dtype: torch.dtype, kernel=None):
        self.name, self.bits, self.n, self.k, self.dtype = name, bits, n, k, dtype
        self.qweight = qweight                                      # (K_pad/16, N_pad*16*bits/32) int32
        self.k_pad, self.n_pad = qweight_kn(qweight.shape, bits)
        self.group_size = group_size_for(self.k_pad, scales.shape[0], name)
        # (n_groups, N_pad), Marlin column order: float16 as stored; the kernel wants the activation dtype (as vLLM)
        self.scales = scales.to(dtype) if kernel is not None else scales
        self.kernel = kernel                                        # ktrun.ops.marlin.MarlinKernel or None
        self.kernel_state = kernel.prepare(self) if kernel is not None else None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * 4 + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> W (N, K) on the layer's device: (code - 2^(bits-1)) * scale in float32, then cast once."""
        codes = marlin_codes(self.qweight, self.bits)                               # (K_pad, N_pad) uint8
        s = marlin_scales(self.scales.float(), grouped=grouped_scales(self.k_pad, self.group_size))
        w = codes.float().sub_(zero_point(self.bits)).view(s.shape[0], -1, self.n_pad)  # (n_groups, G, N_pad)
        w = w.mul_(s[:, None, :]).view(self.k_pad, self.n_pad)[: self.k, : self.n]
        return w.t().to(dtype or self.dtype).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., K) -> (..., N)."""
        if self.kernel is None:
            return F.linear(x, self.dequantize(x.dtype), bias)
        if self.k_pad != self.k:
            x = F.pad(x, (0, self.k_pad - self.k))
        y = self.kernel(self, x.reshape(-1, self.k_pad))[:, : self.n].reshape(*x.shape[:-1], self.n)
        return y if bias is None else y + bias


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: (..., K); w: a dense (N, K) tensor or a MarlinLinear."""
    return F.linear(x, w, b) if isinstance(w, torch.Tensor) else w(x, b)


def linear_start(x: torch.Tensor, w, b: torch.Tensor | None = None):
    """linear(x, w, b) started: -> a function returning its result. A Linear on the CPU kernels (KernelLinear.start)
    runs on the pool meanwhile, so torch work between the two calls overlaps it; any other is computed now."""
    start = getattr(w, "start", None)
    if start is not None:
        return start(x, b)
    y = linear(x, w, b)
    return lambda: y


def dense_weight(w) -> torch.Tensor:
    """The (N, K) tensor of a Linear, dequantizing a packed one (for weights used other than as a matmul)."""
    return w if isinstance(w, torch.Tensor) else w.dequantize()
