"""Per-group scale search for symmetric b-bit codes with a fixed zero point (both CPU expert and GPU layouts):
choose the scale of each group that minimizes the importance-weighted squared error of its dequantized weights.

A group x (L values) with weights w >= 0 (input-channel importance, or 1) is stored as codes q in [qmin, qmax]
(qmin = -2^(b-1), qmax = 2^(b-1) - 1) and one scale s: x ~= s * q. For a trial scale t, q = clamp(rint(x (1 / t)))
(codes_for's reciprocal) and the best scale for those codes is the weighted least-squares one, s = sum(w x q) / sum(w q^2), with
error sum(w x^2) - sum(w x q)^2 / sum(w q^2). Trial scales: the largest-magnitude value `peak` (signed) divided by
qmin (1 + d) for d in a grid of +-12.5% (d = 0 is the plain rule of llama.cpp's Q4_0/Q8_0 and of our CPU layouts, the
largest magnitude onto the most negative code), and by qmax + 1/2 (vLLM's RTN rule), so the search is never worse
than either (its floor). The chosen scale is rounded to the stored dtype (float16, bfloat16 or float32) and the
codes are recomputed against the rounded scale, the way dequantization will see it. Deterministic: no randomness,
ties go to the first trial.

Shapes: x (R, L) float32 (R groups of L values), w (R, L) or (L,) or None; returns scales (R,) float32 (already
representable in the stored dtype) and codes (R, L) as signed integers in float32 (caller adds the zero point).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from ktlayouts import cpu_expert
from ktlayouts.constants import DEFAULT_SCALE_DTYPE, SUB6_RANGE, SUB6_SUPER_SIG_BITS
from ktlayouts.expert_formats import F32_SCALES, scale_encoding
from ktrun.ops.library import kernels_available
from ktrun.ops.scale_search import search_scales as kernel_search_scales


def trial_divisors(bits: int, steps: int = 10, span: float = 0.125) -> list[float]:
    """Divisors of the signed peak: qmin * (1 + d) for d in [-span, span] (2*steps+1 points, 0 first; 4 bits: qmin
    -9 .. -7 in steps of 0.1, llama.cpp's k-quant grid) and qmax + 1/2."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    ds = [0.0] + [span * qmin * i / steps * sgn for i in range(1, steps + 1) for sgn in (1.0, -1.0)]
    return [qmin + d for d in ds] + [-(qmax + 0.5)]


def round_scales(s: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Round to the stored dtype (the scale encoding's torch dtype, ScaleEncoding.runtime_name) and back to float32
    (float16: clamped to its finite range, ScaleEncoding.finite_max)."""
    enc = scale_encoding(scale_dtype)
    if not enc.elementwise:
        raise ValueError(f"{enc.what} ({enc.name}) are not rounded value by value: use search_two_level")
    if enc.finite_max is not None:
        s = s.clamp(-enc.finite_max, enc.finite_max)
    return s.to(getattr(torch, enc.runtime_name)).to(torch.float32)


def codes_for(x: torch.Tensor, s: torch.Tensor, bits: int, reciprocal: bool = False) -> torch.Tensor:
    """x (R, L), s (R,) -> signed codes clamp(rint(x / s)) (0 where s == 0), true division by the stored scale.
    reciprocal: clamp(rint(x * (1 / s))) instead, a trial's codes (1 / s in float32, as the kernel's 1.0f / t): only
    the choice among the trials reads them, and kt_search_scales takes the same product (a division per value and
    trial was most of its time)."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    safe = torch.where(s != 0, s, torch.ones_like(s))[:, None]
    q = torch.round(x * (1.0 / safe) if reciprocal else x / safe).clamp_(qmin, qmax)
    return torch.where(s[:, None] != 0, q, torch.zeros_like(q))


def weighted_error(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(R,) sum over the group of w (x - s q)^2, in float64."""
    d = (x - s[:, None] * q).double()
    return (w.double() * d * d).sum(1)


# Groups searched at once: the search makes ~10 temporaries of x's size per trial, and at 4096 groups of 64 they stay
# in cache and in the allocator's reuse; a whole expert matrix at once (229K groups of 64) spent more time in page
# faults than in arithmetic (measured 4.4 s -> 0.72 s for a 2048 x 7168 matrix, 2 threads, the same bits).
SEARCH_CHUNK_ELEMENTS = 1 << 18


# "kernel": libktkernels' kt_search_scales (ktrun.ops.scale_search) and kt_gptq_block (GPTQ's column loop,
# ktconvert.gpu.gptq) where it loads, else the torch code; "torch": always the torch code (the references the kernels
# are tested against)
SEARCH_IMPL_ENV = "KTCONVERT_SEARCH"


def on_kernel(x: torch.Tensor, enc) -> bool:
    """Whether the search (and GPTQ's column loop around it) runs in libktkernels: scales rounded value by value, CPU
    groups, the library loaded, and not KTCONVERT_SEARCH=torch."""
    return enc.elementwise and x.device.type == "cpu" and os.environ.get(SEARCH_IMPL_ENV, "kernel") != "torch" \
        and kernels_available()


def search_scales(x: torch.Tensor, w: torch.Tensor | None, bits: int, scale_dtype: str = DEFAULT_SCALE_DTYPE,
                  divisors: list[float] | None = None, refine: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (scales (R,), signed codes (R, L)) minimizing sum w (x - s q)^2 per group over the trial scales.
    w: None, (L,) for every group, (R, L), or (P, L) with R a multiple of P (group r takes row r % P: a matrix's
    per-input-channel importance in groups, without expanding it to every row).
    Runs in libktkernels (kt_search_scales, ~10x faster) unless KTCONVERT_SEARCH=torch or the library is missing;
    the two agree except where two trial scales' gains tie to float rounding (tests/test_scale_search_kernel.py)."""
    r = x.shape[0]
    enc = scale_encoding(scale_dtype)
    if on_kernel(x, enc):
        return kernel_search_scales(x, w, bits, enc.runtime_name, divisors or trial_divisors(bits), refine)
    if w is not None and w.dim() == 2 and w.shape[0] != r:
        w = w.repeat(r // w.shape[0], 1)                      # periodic rows -> one row per group
    return _search_in_chunks(x, w, bits, scale_dtype, divisors, refine)


def search_unsigned_codes(x: torch.Tensor, w: torch.Tensor | None, bits: int, scale_dtype: str, zero_point: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """search_scales() with the codes as a layout stores them: (scales (R,), codes + zero_point (R, L) uint8). On the
    library the int8 codes are shifted in place (uint8 arithmetic wraps: v + Z for v in [-Z, Z - 1]) instead of
    going through two float32 arrays of the matrix's size: the same bytes."""
    r = x.shape[0]
    enc = scale_encoding(scale_dtype)
    if on_kernel(x, enc):
        s, q = kernel_search_scales(x, w, bits, enc.runtime_name, trial_divisors(bits), 1, int8_codes=True)
        return s, q.view(torch.uint8).add_(zero_point)
    s, q = search_scales(x, w, bits, scale_dtype)
    return s, (q + zero_point).to(torch.uint8).reshape(r, -1)


def _search_in_chunks(x, w, bits, scale_dtype, divisors, refine):
    """The torch reference, SEARCH_CHUNK_ELEMENTS at a time (groups are independent: the same result)."""
    r, length = x.shape
    step = max(1, SEARCH_CHUNK_ELEMENTS // max(1, length))
    if r <= step:
        return _search_scales(x, w, bits, scale_dtype, divisors, refine)
    rows = w is not None and w.dim() == 2
    parts = [_search_scales(x[i:i + step], w[i:i + step] if rows else w, bits, scale_dtype, divisors, refine)
             for i in range(0, r, step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _search_scales(x: torch.Tensor, w: torch.Tensor | None, bits: int, scale_dtype: str,
                   divisors: list[float] | None, refine: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.to(torch.float32)
    r, length = x.shape
    if w is None:
        w = torch.ones_like(x)
    elif w.dim() == 1:
        w = w.to(torch.float32)[None, :].expand(r, length)
    else:
        w = w.to(torch.float32)
    hi, lo = x.amax(1), x.amin(1)
    peak = torch.where(hi >= -lo, hi, lo)                                  # (R,) signed largest magnitude
    wx = w * x
    best_num = torch.full((r,), -1.0, dtype=torch.float64)                 # sum(w x q)^2 / sum(w q^2), maximized
    best_s = torch.zeros(r, dtype=torch.float32)
    for div in divisors or trial_divisors(bits):
        q = codes_for(x, peak / div, bits, reciprocal=True)
        sxq = (wx * q).sum(1).double()
        sqq = (w * q * q).sum(1).double()
        gain = torch.where(sqq > 0, sxq * sxq / sqq.clamp_min(1e-300), torch.zeros_like(sxq))
        better = gain > best_num
        best_num = torch.where(better, gain, best_num)
        best_s = torch.where(better, torch.where(sqq > 0, sxq / sqq.clamp_min(1e-300), 0.0).float(), best_s)
    s = round_scales(best_s, scale_dtype)
    q = codes_for(x, s, bits)
    for _ in range(refine):                       # least-squares refit for the codes of the rounded scale, once more
        sxq, sqq = (wx * q).sum(1).double(), (w * q * q).sum(1).double()
        s2 = round_scales(torch.where(sqq > 0, sxq / sqq.clamp_min(1e-300), 0.0).float(), scale_dtype)
        q2 = codes_for(x, s2, bits)
        keep = weighted_error(x, w, s2, q2) < weighted_error(x, w, s, q)
        s, q = torch.where(keep, s2, s), torch.where(keep[:, None], q2, q)
    # floor: never worse than the largest magnitude onto qmin (with its stored scale)
    s0 = round_scales(peak / -(1 << (bits - 1)), scale_dtype)
    q0 = codes_for(x, s0, bits)
    worse = weighted_error(x, w, s, q) > weighted_error(x, w, s0, q0)
    s, q = torch.where(worse, s0, s), torch.where(worse[:, None], q0, q)
    zero = peak == 0
    return torch.where(zero, torch.zeros_like(s), s), torch.where(zero[:, None], torch.zeros_like(q), q)


# --- two-level scales (ktlayouts cpu-expert-int4 version 3, `sub6`): a float16 super-scale d per super-block of
# groups, a small integer sub-scale q per group; the group's scale is d * q ------------------------------------------

@dataclass(frozen=True)
class TwoLevelGrid:
    """Sub-scale codes [lo, hi] and the super-scale's significant bits. SUB6 is the layout's (version 3); the others
    exist for the measurements that chose it (bench/two_level_grid.py: 8-bit and unsigned sub-scales)."""
    lo: int
    hi: int
    sig_bits: int


SUB6 = TwoLevelGrid(SUB6_RANGE[0], SUB6_RANGE[1], SUB6_SUPER_SIG_BITS)


def round_super_scale(d: torch.Tensor, grid: TwoLevelGrid = SUB6) -> torch.Tensor:
    """The stored super-scale of d: float16 with grid.sig_bits significant bits (ktlayouts' rounding)."""
    return torch.from_numpy(cpu_expert.round_super_scale(d.detach().to(torch.float32).numpy(), grid.sig_bits))


def sub_scales_for(s: torch.Tensor, d: torch.Tensor, grid: TwoLevelGrid = SUB6) -> torch.Tensor:
    """Nearest sub-scales q = clamp(rint(s / d), lo, hi) of group scales s (R, S) under d (R,); 0 where d = 0."""
    safe = torch.where(d != 0, d, torch.ones_like(d))[:, None]
    q = torch.round(s / safe).clamp_(grid.lo, grid.hi)
    return torch.where(d[:, None] != 0, q, torch.zeros_like(q))


def best_sub_scales(xg: torch.Tensor, wg: torch.Tensor, s: torch.Tensor, d: torch.Tensor, bits: int,
                    grid: TwoLevelGrid = SUB6) -> torch.Tensor:
    """Per group (R * S groups xg (R * S, L), weights wg, free scales s (R, S)) the sub-scale among rint(s / d) - 1,
    +0, +1 (in the grid) whose stored scale d q, with the codes re-rounded against it, has the least weighted
    squared error -> q (R, S) float32 (ties keep rint)."""
    r, n_sub = s.shape
    q0 = sub_scales_for(s, d, grid)
    best_q, best_err = q0, None
    for dq in (0.0, -1.0, 1.0):
        qq = (q0 + dq).clamp(grid.lo, grid.hi)
        sc = (d[:, None] * qq).reshape(-1)
        err = weighted_error(xg, wg, sc, codes_for(xg, sc, bits)).reshape(r, n_sub)
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best_err, best_q = torch.where(better, err, best_err), torch.where(better, qq, best_q)
    return best_q


def super_scale(s: torch.Tensor, c: torch.Tensor, grid: TwoLevelGrid = SUB6, steps: int = 8) -> torch.Tensor:
    """d (R,) for free group scales s (R, S) with curvatures c (R, S) (the error grows as c_g (d q_g - s_g)^2 with
    the codes held): trials max|s| / t, t = hi, hi - 0.5, ... and (signed grids) lo, lo + 0.5, ... (steps each), and
    the least-squares refit sum c s q / sum c q^2 of the best one, each rounded to the stored super-scale and scored
    by sum c (s - d rint(s / d))^2."""
    r = s.shape[0]
    top = s.gather(1, s.abs().argmax(1, keepdim=True))[:, 0]                  # (R,) the largest |s_g|, signed

    def score(d):
        q = sub_scales_for(s, d, grid).double()
        return (c * (s.double() - d.double()[:, None] * q) ** 2).sum(1)

    best_d, best_e = torch.zeros(r), torch.full((r,), float("inf"), dtype=torch.float64)
    trials = [top / (grid.hi - 0.5 * i) for i in range(steps)]
    trials += [top / (grid.lo + 0.5 * i) for i in range(steps)] if grid.lo < 0 else []
    for d in trials + [None]:
        if d is None:                                   # the weighted least-squares refit of the best trial
            q = sub_scales_for(s, best_d, grid).double()
            den = (c * q * q).sum(1)
            d = torch.where(den > 0, (c * s.double() * q).sum(1) / den.clamp_min(1e-300), 0.0).float()
        d = round_super_scale(d, grid)
        e = score(d)
        better = e < best_e
        best_e, best_d = torch.where(better, e, best_e), torch.where(better, d, best_d)
    return best_d


def free_scales(xg: torch.Tensor, wg: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups xg (G, L) -> (each group's best free scale (G,) float32, the curvature sum w code^2 (G,) float64)."""
    s, code = search_scales(xg, wg, bits, F32_SCALES.name)            # free: float32, not rounded
    return s, (wg * code * code).sum(1).double()


def fit_two_level(s: torch.Tensor, c: torch.Tensor, grid: TwoLevelGrid = SUB6) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-level values for given group scales s (R, S) with curvatures c (R, S) (GPTQ's first pass): d by
    super_scale, q = rint(s / d) (the proxy's optimum for that d) -> (d (R,), q (R, S))."""
    d = super_scale(s, c, grid)
    return d, sub_scales_for(s, d, grid)


def _flat_groups(x, w):
    x = x.to(torch.float32)
    r, n_sub, length = x.shape
    w = torch.ones_like(x) if w is None else w.to(torch.float32).expand(r, n_sub, length)
    return x.reshape(r * n_sub, length), w.reshape(r * n_sub, length)


def search_two_level(x: torch.Tensor, w: torch.Tensor | None, bits: int, grid: TwoLevelGrid = SUB6
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two-level scales of super-blocks x (R, S, L) (S groups of L values), importance w (R, S, L), (S, L) or None
    -> (d (R,) stored super-scales, q (R, S) sub-scales of the grid (float32), codes (R, S, L) signed), minimizing
    sum w (x - d q code)^2:
    1. each group's best free scale s_g (search_scales, float32) and the curvature of its error around it;
    2. d by super_scale (trials and a least-squares refit on the sub-scale grid, rounded to the stored super-scale);
    3. each q among rint(s / d) - 1, +0, +1 by the real weighted error of its re-rounded codes (best_sub_scales);
    4. the codes of the final stored scales d q;
    floor (the layout's grid): never worse per super-block than the layout's reference rule (ktlayouts
    two_level_rule on the groups' largest magnitudes onto -2^(b-1)). Deterministic (ties keep the first candidate)."""
    r, n_sub, length = x.shape
    xg, wg = _flat_groups(x, w)
    s, c = free_scales(xg, wg, bits)
    s, c = s.reshape(r, n_sub), c.reshape(r, n_sub)
    d = super_scale(s, c, grid)
    q = best_sub_scales(xg, wg, s, d, bits, grid)
    sc = d[:, None] * q
    if grid != SUB6:
        return d, q, codes_for(xg, sc.reshape(-1), bits).reshape(r, n_sub, length)
    hi, lo = xg.amax(1), xg.amin(1)
    peak = torch.where(hi >= -lo, hi, lo) / -(1 << (bits - 1))
    rule = torch.from_numpy(cpu_expert.two_level_rule(peak.reshape(r, n_sub).numpy()))

    def err(v):                                   # (R,) summed over the super-block's groups
        return weighted_error(xg, wg, v.reshape(-1), codes_for(xg, v.reshape(-1), bits)).reshape(r, n_sub).sum(1)
    worse = err(sc) > err(rule)
    if bool(worse.any()):
        d_rule, q_rule = cpu_expert.two_level_decompose(rule.numpy())
        d = torch.where(worse, torch.from_numpy(d_rule[:, 0]), d)
        q = torch.where(worse[:, None], torch.from_numpy(q_rule.astype(np.float32)), q)
        sc = d[:, None] * q
    return d, q, codes_for(xg, sc.reshape(-1), bits).reshape(r, n_sub, length)
