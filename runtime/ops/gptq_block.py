"""ktrun.ops.gptq_block: the inside of one block of ktconvert's GPTQ column loop in one libktkernels call
(kt_gptq_block, kernels/src/gptq_block.cpp), for the converter (ktconvert.gpu.gptq._quantize_columns is the reference
and the fallback without the library).

Shapes: w (B, N) float32 rows of the transposed weight in processing order (a view with unit column stride), u (B, B)
the block of U, scales (n, N) float32 (searched into with hdiag (B,) given, else read), codes (B, N) uint8 and err
(B, N) float32 written. Runs on the calling thread with the GIL released by ctypes.
"""
from __future__ import annotations

import numpy as np
import torch

from .library import SCALE_DTYPE_CODES, KernelError, load_library


def _rows(t: torch.Tensor, name: str) -> int:
    """The row stride of a 2-D CPU tensor whose rows are contiguous."""
    if t.dim() != 2 or t.stride(1) != 1 or t.device.type != "cpu":
        raise ValueError(f"kt_gptq_block: {name} must be a 2-D CPU tensor with contiguous rows")
    return t.stride(0)


def gptq_block(w: torch.Tensor, u: torch.Tensor, group: int, scales: torch.Tensor, codes: torch.Tensor,
               err: torch.Tensor, bits: int, hdiag: torch.Tensor | None = None, runtime_dtype: str = "float32",
               divisors: list[float] | None = None, refine: int = 1) -> None:
    """hdiag given: the group scales are searched (kt_search_scales with runtime_dtype, divisors, refine) into scales;
    None: scales holds them. Callers check ktrun.ops.library.kernels_available() first."""
    b, n = w.shape
    for t, name in ((w, "w"), (u, "u"), (scales, "scales"), (err, "err")):
        if t.dtype != torch.float32:
            raise ValueError(f"kt_gptq_block: {name} must be float32, got {t.dtype}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"kt_gptq_block: codes must be uint8, got {codes.dtype}")
    search = hdiag is not None
    divs = np.ascontiguousarray(divisors if search else [1.0], dtype=np.float32)
    hd = hdiag.to(torch.float32).contiguous() if search else None
    rc = load_library().kt_gptq_block(
        b, n, w.data_ptr(), _rows(w, "w"), u.data_ptr(), _rows(u, "u"), group, int(search),
        hd.data_ptr() if search else None, bits, SCALE_DTYPE_CODES[runtime_dtype], divs.ctypes.data, divs.size,
        refine, scales.data_ptr(), _rows(scales, "scales"), codes.data_ptr(), _rows(codes, "codes"), err.data_ptr(),
        _rows(err, "err"))
    if rc:
        raise KernelError(f"kt_gptq_block: bad arguments (B={b}, N={n}, group={group}, bits={bits}, "
                          f"{runtime_dtype}, search={search})")
