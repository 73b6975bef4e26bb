"""GPTQ (Frantar et al., 2022) for one Linear: second-order error compensation while rounding column by column.

Given calibration inputs X (T, K) of a Linear with weight W (N, K), GPTQ minimises ||X W^T - X Q^T||^2 using the
Hessian H = 2 X^T X / T (K, K). Columns are quantized in order (or in order of decreasing diag(H), act-order);
the rounding error of each column is spread over the columns not yet quantized through the upper Cholesky factor
U of H^-1. Updates inside a block of 128 columns are applied at once ("lazy batch"), the rest once per block.
Group scales are computed when the first column of a group is reached, from the weights as updated so far: by
default (scale_rule "search") the scale of ktconvert.scale_search.search_scales minimizing the group's
squared error weighted by diag(H) (each input channel's activation energy), never worse than the largest magnitude
onto the most negative code; scale_rule "vllm" keeps the reference rule max|w| / ((2^b - 1) / 2). Two-level scales
(scale_dtype "sub6", CPU experts of layout version 3) take two passes: the first with free float32 group scales
tells what scale each group wants once the error feedback has reached it; their two-level fit (one float16 d per
super-block of 8 groups, q = rint(s / d), weighted by each group's curvature sum diag(H) code^2) is then fixed, and
the second pass rounds every column against those final stored scales d q, so GPTQ also compensates their error.
Quantization is symmetric with the rounding of ktconvert.gpu.rtn, so RTN and GPTQ results share one layout.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace

import numpy as np
import torch
from ktlayouts.expert_formats import F16_SCALES, F32_SCALES, scale_encoding
from ktlayouts.gptq import GptqGeometry
from ktrun.ops.gptq_block import gptq_block as kernel_gptq_block

from ktconvert.gpu.rtn import QuantizedLinear, scales_for
from ktconvert.scale_search import on_kernel, trial_divisors

log = logging.getLogger(__name__)

BLOCK = 128
DAMP_RETRIES = 4      # percdamp, x10, x100, x1000 (capped at 1.0 of the mean diagonal)


class GptqError(RuntimeError):
    """GPTQ cannot quantize a layer (its Hessian stays non positive definite, or holds NaN/inf)."""


@dataclass(frozen=True)
class GptqConfig:
    bits: int = 4
    group_size: int = 128
    percdamp: float = 0.01     # damping added to diag(H), as a fraction of its mean
    block: int = BLOCK
    act_order: bool = False
    scale_rule: str = "search"  # "search": importance-weighted scale search; "vllm": max|w| / ((2^b - 1) / 2)
    scale_dtype: str = F16_SCALES.name   # dtype the scales are stored in (their rounding is part of the search)

    def __post_init__(self):
        if self.scale_rule not in ("search", "vllm"):
            raise ValueError(f"scale_rule must be 'search' or 'vllm', got {self.scale_rule!r}")
        if not 0 < self.percdamp <= 1:
            raise ValueError(f"percdamp must be in (0, 1], got {self.percdamp}")
        enc = scale_encoding(self.scale_dtype)
        if not enc.elementwise and (self.group_size <= 0 or self.act_order):
            raise ValueError(f"{enc.what} need static groups (no act-order), got group {self.group_size}, "
                             f"act_order {self.act_order}")
        if self.block <= 0 or (self.group_size > 0 and self.block % self.group_size):
            raise ValueError(f"block {self.block} must be a multiple of the group size {self.group_size}")


class HessianAccumulator:
    """Running H = 2/T * sum_t x_t x_t^T over all calibration tokens seen by one Linear. Memory: K*K float32."""

    def __init__(self, k: int):
        self.h = torch.zeros(k, k, dtype=torch.float32)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """x: (..., K) inputs of the Linear."""
        x = x.detach().reshape(-1, self.h.shape[0]).to(torch.float32)
        t = x.shape[0]
        if t == 0:
            return
        self.h *= self.tokens / (self.tokens + t)
        self.tokens += t
        x = x * (2.0 / self.tokens) ** 0.5
        self.h.addmm_(x.T, x)


def _upper_factor_of_inverse(h: torch.Tensor) -> torch.Tensor | None:
    """U upper triangular with U^T U = H^-1 (the upper Cholesky factor of H^-1), or None if H is not PD.

    With J the reversal permutation and J H J = C C^T (lower Cholesky), U = J C^-1 J: one Cholesky and one
    triangular solve instead of Cholesky, cholesky_inverse and a second Cholesky.
    """
    c, info = torch.linalg.cholesky_ex(torch.flip(h, (0, 1)))
    if info != 0:
        return None
    return torch.flip(_lower_inverse(c), (0, 1))


INVERSE_BLOCK = 128     # _lower_inverse's blocks of at most this size are solved directly


def _lower_inverse(c: torch.Tensor) -> torch.Tensor:
    """C^-1 of a lower triangular C (K, K), by halves: [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]].
    K^3 / 3 multiply-adds, nearly all in matrix products; a triangular solve against the identity does K^3 / 2 in a
    slower routine (K = 2048 on one Zen 4 core: 0.08 s against 0.2 s; torch has no trtri)."""
    k = c.shape[0]
    if k <= INVERSE_BLOCK:
        return torch.linalg.solve_triangular(c, torch.eye(k, dtype=c.dtype), upper=False)
    m = k // 2
    a_inv, d_inv = _lower_inverse(c[:m, :m]), _lower_inverse(c[m:, m:])
    out = torch.zeros(k, k, dtype=c.dtype)
    out[:m, :m] = a_inv
    out[m:, m:] = d_inv
    out[m:, :m] = -(d_inv @ (c[m:, :m] @ a_inv))
    return out


def _inverse_cholesky(h: torch.Tensor, percdamp: float, name: str) -> tuple[torch.Tensor, float]:
    """-> (U upper Cholesky factor of (H + damp I)^-1, damping used). Retries with 10x damping, then raises."""
    if not torch.isfinite(h).all():
        raise GptqError(f"{name}: Hessian holds NaN or inf (calibration activations overflowed?)")
    mean_diag = float(torch.diag(h).mean())
    if mean_diag <= 0:
        raise GptqError(f"{name}: Hessian has non-positive mean diagonal {mean_diag:g}: not positive definite")
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    pd = percdamp
    for attempt in range(DAMP_RETRIES):
        pd = min(percdamp * 10 ** attempt, 1.0)
        u = _upper_factor_of_inverse(h + pd * mean_diag * eye)
        if u is not None and torch.isfinite(u).all():
            if attempt:
                log.warning("%s: Hessian not positive definite with damping %g, used %g", name, percdamp, pd)
            return u, pd
        if pd >= 1.0:
            break
    raise GptqError(f"{name}: Hessian is not positive definite even with damping {pd:g} x mean(diag(H)) "
                    f"(tried from {percdamp:g}); calibration inputs may be degenerate")


_WORK = threading.local()


def _work_matrix(k: int, n: int) -> torch.Tensor:
    """A (K, N) float32 matrix for the column loop, from this thread's one reused buffer (grown when too small): a
    routed expert's 7168 x 2048 is above glibc's 32 MiB mmap threshold, so a fresh one was fresh pages for the kernel
    to zero on every matrix (slow on a VM guest). Nothing of it outlives _gptq."""
    buf = getattr(_WORK, "buf", None)
    if buf is None or buf.numel() < k * n:
        _WORK.buf = buf = None                       # the old one freed before the new one is touched
        _WORK.buf = buf = torch.empty(k * n, dtype=torch.float32)
    return buf[: k * n].view(k, n)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, cfg: GptqConfig, name: str = "weight"
                  ) -> tuple[QuantizedLinear, float]:
    """weight (N, K), hessian (K, K) -> (QuantizedLinear, proxy loss sum (w - q)^2 / d^2 over the matrix)."""
    return _gptq(weight, hessian, cfg, name)


def _gptq(weight: torch.Tensor, hessian: torch.Tensor, cfg: GptqConfig, name: str) -> tuple[QuantizedLinear, float]:
    n, k = weight.shape
    geom = GptqGeometry(n, k, cfg.bits, cfg.group_size)
    if hessian.shape != (k, k):
        raise GptqError(f"{name}: Hessian shape {tuple(hessian.shape)} != ({k}, {k})")
    h = hessian.detach().to(torch.float32).clone()
    dead = torch.diag(h) == 0                    # inputs that were always zero: weight irrelevant
    h[dead, dead] = 1.0
    # the weight as the column loop updates it: its transpose (K, N) in float32, one copy in this thread's reused
    # buffer (_work_matrix), dead inputs zeroed, rows in processing order
    wt = _work_matrix(k, n)
    wt.copy_(weight.detach().T)
    wt[dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if cfg.act_order else None
    if perm is not None:
        wt, h = wt[perm], h[perm][:, perm]
    u, _ = _inverse_cholesky(h, cfg.percdamp, name)

    # torch's thread count is never changed here (it is process-wide: the converter's workers and its calibration
    # forward run torch at the same time, and a matmul's bits may depend on it)
    two_level = not scale_encoding(cfg.scale_dtype).elementwise
    fixed = _two_level_scales(wt, u, geom, cfg, torch.diag(h)) if two_level else None
    codes, scales, loss = _quantize_columns(wt, u, geom, cfg, torch.diag(h), fixed)     # codes (K, N) uint8

    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[inv]                       # back to input-channel order (whole rows)
        g_idx = (inv // geom.group).to(torch.int32).numpy()
    else:
        g_idx = geom.default_g_idx()
    # float16 for the GPU layouts; other scale dtypes (CPU expert layouts) keep float32 holding their values
    sdt = torch.float16 if cfg.scale_dtype == F16_SCALES.name else torch.float32
    q = QuantizedLinear(codes.numpy(), scales.to(sdt).numpy(), np.ascontiguousarray(g_idx), geom)
    return q, float(loss)


def group_scales(w_group: torch.Tensor, importance: torch.Tensor, cfg: GptqConfig) -> torch.Tensor:
    """w_group (N, L) columns of one group, importance (L,) -> (N,) scales, representable in cfg.scale_dtype."""
    if cfg.scale_rule == "vllm":
        return scales_for(w_group, cfg.bits)
    from ktconvert.scale_search import search_scales
    return search_scales(w_group, importance, cfg.bits, cfg.scale_dtype)[0]


def _two_level_scales(wt: torch.Tensor, u: torch.Tensor, geom: GptqGeometry, cfg: GptqConfig,
                      hdiag: torch.Tensor) -> torch.Tensor:
    """Two-level scales' first pass: GPTQ on a copy of wt (K, N) with free float32 group scales, then the fit of those
    scales (ktconvert.scale_search.fit_two_level, per row and super-block of 8 groups, each group weighted by
    sum diag(H) code^2) -> the final stored scales d q (n_groups, N) for the second pass."""
    from ktconvert.scale_search import fit_two_level

    n = wt.shape[1]
    codes, scales, _ = _quantize_columns(wt.clone(), u, geom, replace(cfg, scale_dtype=F32_SCALES.name), hdiag)
    q = codes.T.to(torch.float32) - float(1 << (cfg.bits - 1))         # (N, K)
    curv = (hdiag[None, :] * q * q).reshape(n, geom.n_groups, geom.group).sum(2).double()     # (N, n_groups)
    sb = scale_encoding(cfg.scale_dtype).super_groups
    pad = -geom.n_groups % sb                 # a last partial super-block (K not a multiple of 8 groups)
    s = torch.nn.functional.pad(scales.T, (0, pad)).reshape(-1, sb)
    c = torch.nn.functional.pad(curv, (0, pad)).reshape(-1, sb)
    d, qq = fit_two_level(s, c)
    return (d[:, None] * qq).reshape(n, -1)[:, : geom.n_groups].T.contiguous()


_ROUNDER = 1.5 * 2.0 ** 23


def _round_half_even_(x: torch.Tensor) -> torch.Tensor:
    """torch.round_(x) for the column loop's codes, in place: adding and subtracting 1.5 x 2^23 rounds a float32 to
    the nearest integer, ties to even, exactly as torch.round does for |x| < 2^22; beyond that the caller's clamp
    to the code range gives the same codes either way (inf and NaN pass through alike). torch.round on one column
    (thousands of values) runs as a parallel region: 66-164 us with 2 threads against 1.7 us on one, once per
    column; the two additions never wake other threads at that size."""
    return x.add_(_ROUNDER).sub_(_ROUNDER)


def _quantize_columns(wt: torch.Tensor, u: torch.Tensor, geom: GptqGeometry, cfg: GptqConfig,
                      hdiag: torch.Tensor, fixed: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPTQ column loop: wt (K, N) float32 contiguous, the weight's transpose in processing order (updated in
    place), u (K, K), hdiag (K,) the Hessian's diagonal in processing order, fixed: (n_groups, N) scales to use
    instead of choosing them -> codes (K, N) uint8, scales (n_groups, N), loss.

    It works on the transpose: a column of the weight is a contiguous row, so each column's rank-1 update of the
    block's later columns streams whole rows (on the (N, K) weight it strided over N rows; a 7168 x 2048 down_proj
    took 3x longer). Inside a block the columns run in libktkernels (kt_gptq_block: the same bits; that down_proj's
    whole GPTQ 1.36 -> 0.9-1.1 s) where it loads and the scale search runs there too (ktconvert.scale_search.
    on_kernel), else in torch (_block_reference, the reference); the rows after the block take one matrix product
    either way."""
    k, n = wt.shape
    codes = torch.empty(k, n, dtype=torch.uint8)              # (K, N) in processing order, every row written
    scales = torch.zeros(geom.n_groups, n, dtype=torch.float32)
    loss = torch.zeros((), dtype=torch.float64)
    if cfg.group_size == -1:
        scales[0] = group_scales(wt.T, hdiag, cfg)
    searched = _searched_in_loop(cfg, fixed)
    use_kernel = (not searched or cfg.scale_rule == "search") and \
        on_kernel(wt, scale_encoding(cfg.scale_dtype if searched else F32_SCALES.name))
    for i1 in range(0, k, cfg.block):
        i2 = min(i1 + cfg.block, k)
        err1 = torch.empty(i2 - i1, n, dtype=torch.float32)
        (_block_on_kernel if use_kernel else _block_reference)(wt, u, geom, cfg, hdiag, fixed, i1, i2, codes, scales,
                                                              err1)
        loss += (err1.double() ** 2).sum()
        if i2 < k:
            wt[i2:].addmm_(u[i1:i2, i2:].T, err1, alpha=-1.0)
    return codes, scales, loss


def _searched_in_loop(cfg: GptqConfig, fixed: torch.Tensor | None) -> bool:
    """Whether the group scales are chosen inside the column loop, at each group's first column (not fixed in
    advance, not one per row chosen before it)."""
    return fixed is None and cfg.group_size != -1


def _block_reference(wt, u, geom, cfg, hdiag, fixed, i1, i2, codes, scales, err1) -> None:
    """Columns i1 .. i2-1 (one block) in torch: their codes, scales (at each group's first column) and errors err1
    (B, N); the block's later rows of wt updated column by column."""
    group = geom.group
    zero, maxq = float(1 << (cfg.bits - 1)), float((1 << cfg.bits) - 1)
    w1 = wt[i1:i2]                                           # (B, N) view, updated in place
    u1 = u[i1:i2, i1:i2]
    s = scales[i1 // group]                                  # a block starts a group, or lies in the per-row one
    safe = torch.where(s != 0, s, torch.ones_like(s))
    for i in range(i2 - i1):
        col = i1 + i
        if col % group == 0:
            if fixed is not None:
                scales[col // group] = fixed[col // group]
            elif cfg.group_size != -1:
                # group scale from the weights as updated so far: the group lies inside this block
                scales[col // group] = group_scales(w1[i:i + group].T, hdiag[col:col + group], cfg)
            s = scales[col // group]
            safe = torch.where(s != 0, s, torch.ones_like(s))   # all-zero group: scale 0, any code
        wi = w1[i]
        c = torch.clamp_(_round_half_even_(wi / safe).add_(zero), 0.0, maxq)   # same rounding as rtn
        codes[col] = c
        e = (wi - (c - zero) * s) / u1[i, i]
        err1[i] = e
        if i + 1 < i2 - i1:
            # the product rounded, then the subtraction: the same bits on every CPU (addr_ fuses the multiply-add in
            # its vector loop and not in its remainder, which varies with torch's CPU capability)
            w1[i + 1:].sub_(u1[i, i + 1:, None] * e)


def _block_on_kernel(wt, u, geom, cfg, hdiag, fixed, i1, i2, codes, scales, err1) -> None:
    """_block_reference in one kt_gptq_block call (wt's block rows are read, not updated: only err1 is used after)."""
    group = geom.group
    g0 = i1 // group
    search = _searched_in_loop(cfg, fixed)
    if fixed is not None:
        scales[g0:-(-i2 // group)] = fixed[g0:-(-i2 // group)]
    # u is column-major (the flipped triangular solve): its (B, B) block copied row-major (64 KB at B = 128)
    kernel_gptq_block(wt[i1:i2], u[i1:i2, i1:i2].contiguous(), group, scales[g0:], codes[i1:i2], err1, cfg.bits,
                      hdiag[i1:i2] if search else None, scale_encoding(cfg.scale_dtype).runtime_name,
                      trial_divisors(cfg.bits))
