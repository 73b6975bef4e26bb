"""Per-group scale search for symmetric b-bit codes with a fixed zero point (both CPU expert and GPU layouts):
choose the scale of each group that minimizes the importance-weighted squared error of its dequantized weights.

A group x (L values) with weights w >= 0 (input-channel importance, or 1) is stored as codes q in [qmin, qmax]
(qmin = -2^(b-1), qmax = 2^(b-1) - 1) and one scale s: x ~= s * q. For a trial scale t, q = clamp(rint(x / t)) and
the best scale for those codes is the weighted least-squares one, s = sum(w x q) / sum(w q^2), with error
sum(w x^2) - sum(w x q)^2 / sum(w q^2). Trial scales: the largest-magnitude value `peak` (signed) divided by
qmin (1 + d) for d in a grid of +-12.5% (d = 0 is the plain rule of llama.cpp's Q4_0/Q8_0 and of our CPU layouts, the
largest magnitude onto the most negative code), and by qmax + 1/2 (vLLM's RTN rule), so the search is never worse
than either (its floor). The chosen scale is rounded to the stored dtype (float16, bfloat16 or float32) and the
codes are recomputed against the rounded scale, the way dequantization will see it. Deterministic: no randomness,
ties go to the first trial.

Shapes: x (R, L) float32 (R groups of L values), w (R, L) or (L,) or None; returns scales (R,) float32 (already
representable in the stored dtype) and codes (R, L) as signed integers in float32 (caller adds the zero point).
"""
from __future__ import annotations

import torch

SCALE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
FP16_MAX = 65504.0


def trial_divisors(bits: int, steps: int = 10, span: float = 0.125) -> list[float]:
    """Divisors of the signed peak: qmin * (1 + d) for d in [-span, span] (2*steps+1 points, 0 first; 4 bits: qmin
    -9 .. -7 in steps of 0.1, llama.cpp's k-quant grid) and qmax + 1/2."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    ds = [0.0] + [span * qmin * i / steps * sgn for i in range(1, steps + 1) for sgn in (1.0, -1.0)]
    return [qmin + d for d in ds] + [-(qmax + 0.5)]


def round_scales(s: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Round to the stored dtype and back to float32 (float16: clamped to its finite range)."""
    if scale_dtype == "f32":
        return s
    if scale_dtype == "f16":
        s = s.clamp(-FP16_MAX, FP16_MAX)
    return s.to(SCALE_DTYPES[scale_dtype]).to(torch.float32)


def codes_for(x: torch.Tensor, s: torch.Tensor, bits: int) -> torch.Tensor:
    """x (R, L), s (R,) -> signed codes clamp(rint(x / s)) (0 where s == 0), true division by the stored scale."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    safe = torch.where(s != 0, s, torch.ones_like(s))[:, None]
    q = torch.round(x / safe).clamp_(qmin, qmax)
    return torch.where(s[:, None] != 0, q, torch.zeros_like(q))


def weighted_error(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(R,) sum over the group of w (x - s q)^2, in float64."""
    d = (x - s[:, None] * q).double()
    return (w.double() * d * d).sum(1)


def search_scales(x: torch.Tensor, w: torch.Tensor | None, bits: int, scale_dtype: str = "f16",
                  divisors: list[float] | None = None, refine: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (scales (R,), signed codes (R, L)) minimizing sum w (x - s q)^2 per group over the trial scales."""
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
        t = peak / div
        q = codes_for(x, t, bits)
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


# --- two-level scales: one super-scale per super-block of groups, a small signed integer sub-scale per group --------

def round_super_scale(d: torch.Tensor, sig_bits: int = 11) -> torch.Tensor:
    """d float32 -> the nearest float16 value with at most sig_bits significant bits (significand rounded half to even),
    as float32. With sig_bits + the sub-scales' magnitude bits <= 11 every product d * q is a float16 value as well
    (in float16's normal range), so GPU formats with float16 scales hold the two-level scales exactly."""
    d = d.to(torch.float32).clamp(-FP16_MAX, FP16_MAX)
    m, e = torch.frexp(d)                                        # d = m 2^e, 0.5 <= |m| < 1
    m = torch.round(m * float(1 << sig_bits)) / float(1 << sig_bits)
    return torch.ldexp(m, e.to(torch.float32)).clamp(-FP16_MAX, FP16_MAX).to(torch.float16).to(torch.float32)


def sub_scales_for(s: torch.Tensor, d: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Nearest integer sub-scales q = clamp(rint(s / d), lo, hi) of group scales s (R, S) under d (R,); 0 where d = 0."""
    safe = torch.where(d != 0, d, torch.ones_like(d))[:, None]
    q = torch.round(s / safe).clamp_(lo, hi)
    return torch.where(d[:, None] != 0, q, torch.zeros_like(q))


def search_two_level(x: torch.Tensor, w: torch.Tensor | None, bits: int, sub_range: tuple[int, int],
                     sig_bits: int, steps: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two-level scales of super-blocks x (R, S, L) (S groups of L values), importance w (R, S, L), (S, L) or None:
    -> (d (R,) super-scales, q (R, S) integer sub-scales in sub_range as float32, codes (R, S, L) signed), minimizing
    sum w (x - d q code)^2.

    1. each group's best free scale s_g and its codes (search_scales, float32), and the curvature of the group's error
       around it, c_g = sum w code^2 (the error grows as c_g (s - s_g)^2 with the codes held);
    2. d from trials: the largest |s_g| divided by the top sub-scale codes (hi, and lo for signed ranges) minus
       0 .. steps/2 in half steps, plus the weighted least-squares refit sum c s q / sum c q^2 of the best trial,
       each rounded to the stored super-scale (round_super_scale) and scored by sum c (s - d q)^2 with
       q = rint(s / d);
    3. per group, q - 1, q, q + 1 scored by the real weighted error with the codes re-rounded against d q;
    4. the codes of the final stored scales d q.
    Deterministic (ties keep the first candidate)."""
    x = x.to(torch.float32)
    r, n_sub, length = x.shape
    if w is None:
        w = torch.ones_like(x)
    else:
        w = w.to(torch.float32).expand(r, n_sub, length)
    xg, wg = x.reshape(r * n_sub, length), w.reshape(r * n_sub, length)
    s, code = search_scales(xg, wg, bits, "f32")
    c = (wg * code * code).sum(1).double().reshape(r, n_sub)
    return fit_two_level(xg, wg, s.reshape(r, n_sub), c, bits, sub_range, sig_bits, steps)


def fit_two_level(xg, wg, s, c, bits, sub_range, sig_bits, steps=8):
    """Steps 2-4 of search_two_level from the groups' free scales s (R, S) and curvatures c (R, S)."""
    r, n_sub = s.shape
    length = xg.shape[1]
    lo, hi = sub_range
    top = s.gather(1, s.abs().argmax(1, keepdim=True))[:, 0]                  # (R,) the largest |s_g|, signed
    tops = [hi - 0.5 * i for i in range(steps)] + ([lo + 0.5 * i for i in range(steps)] if lo < 0 else [])

    def score(d):
        q = sub_scales_for(s, d, lo, hi)
        return (c * (s.double() - d.double()[:, None] * q.double()) ** 2).sum(1)

    best_d = torch.zeros(r)
    best_e = torch.full((r,), float("inf"), dtype=torch.float64)
    for t in tops:
        d = round_super_scale(top / t, sig_bits)
        e = score(d)
        better = e < best_e
        best_e, best_d = torch.where(better, e, best_e), torch.where(better, d, best_d)
    q = sub_scales_for(s, best_d, lo, hi).double()
    den = (c * q * q).sum(1)
    d = round_super_scale(torch.where(den > 0, (c * s.double() * q).sum(1) / den.clamp_min(1e-300), 0.0).float(),
                          sig_bits)
    e = score(d)
    best_d = torch.where(e < best_e, d, best_d)
    # 3. the sub-scales by the real error of their re-rounded codes
    q0 = sub_scales_for(s, best_d, lo, hi)
    best_q, best_err = q0, None
    for dq in (0.0, -1.0, 1.0):
        qq = (q0 + dq).clamp(lo, hi)
        sc = (best_d[:, None] * qq).reshape(-1)
        err = weighted_error(xg, wg, sc, codes_for(xg, sc, bits)).reshape(r, n_sub)
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best_err, best_q = torch.where(better, err, best_err), torch.where(better, qq, best_q)
    sc = (best_d[:, None] * best_q).reshape(-1)
    return best_d, best_q, codes_for(xg, sc, bits).reshape(r, n_sub, length)
