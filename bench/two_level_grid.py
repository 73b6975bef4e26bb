"""Why the two-level layout (cpu-expert-int4 version 3, `--scale-dtype sub6`) has signed 6-bit sub-scales and 6
significant bits in its float16 super-scale: the weight error of each candidate grid on the default model's routed
experts, against the one-level layouts at their bits per weight.

Every candidate quantizes the same matrices (all routed experts of the embedded default model, K padded to 256) with
ktconvert.scale_search's two-level search on its grid (uniform importance: no calibration, so the numbers compare
grids, not calibration), and the one-level rows with search_scales. Prints `name: value unit` lines: the squared
error relative to the weights' energy, and bits per weight (4 + sub-scale bits / 32 + 16 / 256).

    .venv/bin/python bench/two_level_grid.py            # ~2 minutes on 2 cores
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors import safe_open

from ktconvert.scale_search import (
    SUB6,
    TwoLevelGrid,
    best_sub_scales,
    codes_for,
    search_scales,
    search_two_level,
    super_scale,
    weighted_error,
)

MODEL = Path(__file__).resolve().parents[1] / "ktconvert" / "data" / "default_model"
GRIDS = {   # name: (grid, sub-scale bits)
    "signed6_sig6 (the layout)": (SUB6, 6),
    "signed6_sig11": (TwoLevelGrid(-32, 31, 11), 6),
    "signed8_sig3": (TwoLevelGrid(-128, 127, 3), 8),
    "signed8_sig11": (TwoLevelGrid(-128, 127, 11), 8),
    "signed5_sig7": (TwoLevelGrid(-16, 15, 7), 5),
}


def expert_rows() -> torch.Tensor:
    """Every routed-expert matrix of the default model, K zero-padded to 256, as rows of one super-block (R, 256)."""
    rows = []
    for f in sorted(MODEL.glob("*.safetensors")):
        with safe_open(str(f), "pt") as g:
            for k in g.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if ".experts." in k and k.endswith("_proj.weight"):
                    w = g.get_tensor(k).float()
                    pad = torch.zeros(w.shape[0], -w.shape[1] % 256)
                    rows.append(torch.cat([w, pad], 1).reshape(-1, 256))
    return torch.cat(rows)


def unsigned6(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 6-bit sub-scales under one signed d per super-block: every group's scale has d's sign, so a group whose
    peak has the other sign maps it onto +7 instead of -8. Both signs of d tried per super-block, the better kept."""
    grid = TwoLevelGrid(0, 63, 5)
    xg = x.reshape(-1, 32)
    wg = torch.ones_like(xg)
    s_neg, c_neg = search_scales(xg, wg, 4, "f32")              # peak onto -8: the scale has the peak's other sign
    hi, lo = xg.amax(1), xg.amin(1)
    peak = torch.where(hi >= -lo, hi, lo)
    s_pos = c_pos = e_pos = None
    for div in [7 + 0.05 * i for i in range(21)]:                # peak onto +7: the scale has the peak's sign
        t = peak / div
        c = codes_for(xg, t, 4)
        sxq, sqq = (xg * c).sum(1), (c * c).sum(1)
        t = torch.where(sqq > 0, sxq / sqq.clamp_min(1e-30), t)
        c = codes_for(xg, t, 4)
        e = weighted_error(xg, wg, t, c)
        if s_pos is None:
            s_pos, c_pos, e_pos = t, c, e
        else:
            b = e < e_pos
            s_pos, c_pos, e_pos = torch.where(b, t, s_pos), torch.where(b[:, None], c, c_pos), torch.where(b, e, e_pos)
    best_err = best_w = None
    for sign in (1.0, -1.0):
        keep = s_neg * sign >= 0
        s = torch.where(keep, s_neg, s_pos).reshape(-1, 8) * sign
        cc = torch.where(keep[:, None], c_neg, c_pos)
        curv = (cc * cc).sum(1).double().reshape(-1, 8)
        d = super_scale(s, curv, grid)
        q = best_sub_scales(xg * sign, wg, s, d, 4, grid)
        sc = (sign * d[:, None] * q).reshape(-1)
        err = weighted_error(xg, wg, sc, codes_for(xg, sc, 4)).reshape(-1, 8).sum(1)
        deq = (sc[:, None] * codes_for(xg, sc, 4)).reshape(-1, 256)
        if best_err is None:
            best_err, best_w = err, deq
        else:
            b = err < best_err
            best_err, best_w = torch.where(b, err, best_err), torch.where(b[:, None], deq, best_w)
    return best_w


def main() -> None:
    t0 = time.perf_counter()
    x = expert_rows()
    energy = float((x.double() ** 2).sum())

    def report(name: str, deq: torch.Tensor, bpw: float) -> None:
        print(f"two_level_grid.{name}.rel_sq_error: {float(((x.double() - deq.double()) ** 2).sum()) / energy:.6f}")
        print(f"two_level_grid.{name}.bpw: {bpw:.4f} bits/weight")

    print(f"# {x.shape[0]} rows of 256 weights ({x.numel() / 1e6:.1f} M weights) of the default model's routed experts")
    for g in (32, 64):
        s, q = search_scales(x.reshape(-1, g), None, 4, "f16")
        report(f"g{g}_f16", (s[:, None] * q).reshape(x.shape), 4 + 16 / g)
    for name, (grid, bits) in GRIDS.items():
        d, q, codes = search_two_level(x.reshape(-1, 8, 32), None, 4, grid)
        report(name.split()[0], ((d[:, None] * q)[:, :, None] * codes).reshape(x.shape), 4 + bits / 32 + 16 / 256)
    report("unsigned6_sig5", unsigned6(x), 4 + 6 / 32 + 16 / 256)
    print(f"two_level_grid.seconds: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
