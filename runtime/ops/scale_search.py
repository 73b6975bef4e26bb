"""ktrun.ops.scale_search: ktconvert's importance-weighted scale search in one libktkernels call per matrix
(kt_search_scales, kernels/src/scale_search.cpp), for the converter (ktconvert.scale_search.search_scales is the
reference and the fallback without the library).

Shapes: x (R, L) float32 groups, w None (uniform) or (P, L) float32 with R a multiple of P (group r weighted by row
r % P: one importance row per input channel group of a matrix, or P = R) -> scales (R,) float32 (representable in
the stored dtype), codes (R, L) float32 signed integers. Runs on the calling thread (the converter's workers each
run their own matrices), with the GIL released by ctypes.
"""
from __future__ import annotations

import numpy as np
import torch

from .library import SCALE_DTYPE_CODES, KernelError, load_library


def search_scales(x: torch.Tensor, w: torch.Tensor | None, bits: int, runtime_dtype: str, divisors: list[float],
                  refine: int, int8_codes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """runtime_dtype: the stored scales' torch dtype name (float32, bfloat16, float16). int8_codes: the codes as the
    library writes them, (R, L) int8, instead of float32 (a matrix-sized float array less). Callers check
    ktrun.ops.library.kernels_available() first."""
    x = x.to(torch.float32).contiguous()
    r, length = x.shape
    w_rows = 0
    if w is not None:
        w = w.to(torch.float32).reshape(-1, length).contiguous()
        w_rows = w.shape[0]
        if r % w_rows:
            raise ValueError(f"kt_search_scales: {r} groups are not a multiple of {w_rows} weight rows")
    divs = np.ascontiguousarray(divisors, dtype=np.float32)
    scales = torch.empty(r, dtype=torch.float32)
    codes = torch.empty(r, length, dtype=torch.int8)
    rc = load_library().kt_search_scales(r, length, x.data_ptr(), length, None if w is None else w.data_ptr(),
                                         w_rows, bits, SCALE_DTYPE_CODES[runtime_dtype], divs.ctypes.data, divs.size,
                                         refine, scales.data_ptr(), codes.data_ptr())
    if rc:
        raise KernelError(f"kt_search_scales: bad arguments (R={r}, L={length}, bits={bits}, {runtime_dtype})")
    return scales, codes if int8_codes else codes.to(torch.float32)
