"""ktrun.cpu_glue: the decode step's float32 glue in single libktkernels calls on the calling thread, bit-identical to
the torch ops they replace: RMSNorm rows, optionally after a residual add (kt_rms_norm, torch's CPU F.rms_norm), and
the rotary embedding (kt_rope, ktrun.models.layers.Rope.apply's elementwise formula).

Why: torch's F.rms_norm on the CPU is a composite of 8 aten ops (pow, mean = sum + div, add, rsqrt, mul, mul). A
decode step runs 13 norms between kernel jobs, while the pool idles, and right after a job has streamed hundreds of MB
through the caches each op's dispatch costs ~7-15 us: 53-114 us per norm (10 us hot). One C call is a few us.

Bit-identity is what lets it replace torch's op for every T (a token's bits must not depend on how many tokens
share its forward): the mean's sum follows torch's cascaded vector sum, whose vector width is that of the reduction
kernel torch dispatches to (8 floats on x86 today, AVX2 and AVX-512 alike; kernels/src/rms_norm.cpp). The width is
found once per process by comparing the op with torch on probe rows (8, then 16); if neither matches (another
torch), every norm stays torch's. Rows longer than torch's grain (32768 floats) stay torch's too: one such row is
summed by several threads there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_moe import KernelError, load_library

MAX_D = 32767            # torch sums a longer single row in two passes over its threads (a different order)
_PROBE_D = (16, 100, 512, 1536, 7168, 7171)
_state: dict = {}        # "lanes": the vector width that matches torch (0: none / no library), "lib"


def _library():
    if "lib" not in _state:
        try:
            _state["lib"] = load_library()
        except (KernelError, OSError):
            _state["lib"] = None
    return _state["lib"]


def _lanes() -> int:
    if "lanes" not in _state:
        _state["lanes"] = 0
        if _library() is None:
            return 0
        g = torch.Generator().manual_seed(1234)
        probes = []
        for d in _PROBE_D:
            x, dx, w = torch.randn(3, d, generator=g) * 3, torch.randn(3, d, generator=g), torch.randn(d, generator=g)
            probes.append((x, dx, w, x + dx, F.rms_norm(x + dx, (d,), w, 1e-6)))
        for lanes in (8, 16):
            _state["lanes"] = lanes
            if all(torch.equal(got[0], s) and torch.equal(got[1], want)
                   for x, dx, w, s, want in probes for got in [_call(x, dx, w, 1e-6)]):
                return lanes
        _state["lanes"] = 0
    return _state["lanes"]


def supported(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether add_rms_norm / rms_norm run x (..., D) here: float32 CPU rows of D <= MAX_D contiguous floats, a
    contiguous float32 weight of D, and the library's sum matching torch's."""
    d = x.shape[-1] if x.dim() else 0
    return (x.dtype == torch.float32 and x.is_cpu and 16 <= d <= MAX_D and x.stride(-1) == 1
            and (weight is None or (weight.dtype == torch.float32 and weight.is_cpu and weight.is_contiguous()
                                    and weight.numel() == d))
            and (_state.get("lanes") or _lanes()) > 0)


def _call(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.dim() == 2                        # (T, D): no reshape / view ops (each a dispatch in a decode step)
    x2 = x if flat else x.reshape(-1, x.shape[-1])   # a view for the decode shapes ((T, h, d) rows)
    T, D = x2.shape
    out = torch.empty((T, D), dtype=torch.float32)
    s = d2 = None
    if delta is not None:
        d2 = delta if flat else delta.reshape(T, D)
        s = torch.empty((T, D), dtype=torch.float32)
    if T and _state["lib"].kt_rms_norm(T, D, x2.data_ptr(), x2.stride(0) if T > 1 else D,
                                       None if d2 is None else d2.data_ptr(), d2.stride(0) if d2 is not None and T > 1
                                       else D, None if s is None else s.data_ptr(), D,
                                       None if weight is None else weight.data_ptr(), eps, _state["lanes"],
                                       out.data_ptr(), D) != 0:
        raise KernelError(f"kt_rms_norm: bad arguments (T={T}, D={D}, lanes {_state['lanes']})")
    if flat:
        return (x if s is None else s), out
    return (x if s is None else s.view(x.shape)), out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (D,), weight, eps) for supported(x, weight), in one call."""
    return _call(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x + delta, F.rms_norm(x + delta, (D,), weight, eps)) in one call; x and delta supported, same shape."""
    return _call(x, delta, weight, eps)


def rope_supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether rope() runs x (T, heads, 2*half) with cos / sin (T, half): float32 CPU, contiguous last dims, the
    library loaded."""
    return (x.dtype == torch.float32 and cos.dtype == torch.float32 and sin.dtype == torch.float32 and x.is_cpu
            and x.dim() == 3 and cos.dim() == 2 and x.shape[2] == 2 * cos.shape[1] and x.shape[0] == cos.shape[0]
            and sin.shape == cos.shape and x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
            and _library() is not None)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (T, heads, 2*half), cos / sin (T, half) -> a new (T, heads, 2*half) tensor: Rope.apply's result, with the
    interleaved pairs' output in [evens', odds'] order as there (rope_supported(x, cos, sin))."""
    T, H, D = x.shape
    out = torch.empty((T, H, D), dtype=torch.float32)
    if T and H and _state["lib"].kt_rope(T, H, D // 2, x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(),
                                         sin.data_ptr(), cos.stride(0), int(interleaved), out.data_ptr(), H * D,
                                         D) != 0:
        raise KernelError(f"kt_rope: bad arguments (x {tuple(x.shape)}, cos {tuple(cos.shape)})")
    return out
