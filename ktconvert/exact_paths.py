"""Already-quantized sources: which tensors are taken over exactly, which are re-quantized, and what it cost.

A source offers `int_grid(name)` (ktconvert.sources.quantized.grid.IntGrid: integers times per-group scales) for its
integer-grid weights (compressed-tensors int, GPTQ, AWQ, MXFP4, GGUF Q8_0 / Q4_0) and `quant_format(name)` (its
WeightFormat, from the header alone). Where the grid fits the target layout, codes and scales are copied and the
converted weight dequantizes to exactly the source's values; everything else is dequantized to float32 (one tensor
at a time, as for BF16 sources) and quantized again, and the relative error ||W_out - W_src|| / ||W_src|| it
introduces is measured. `PathLog` collects both and the converter prints them (per layer and at the end).

The scale check is on values, through the target's own storage (the CPU layout's pack_scales/unpack_scales, the GPU
formats' float16), so a layout whose scales change width keeps this test honest.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np
from ktlayouts.constants import GROUP_PER_ROW
from ktlayouts.cpu_expert import MatrixGeometry, pack_scales, scales_representable, unpack_scales
from ktlayouts.expert_formats import INT4, UNDECLARED_SCALE_DTYPE, LayoutError, expert_format_of_bits

from ktconvert.sources.quantized.grid import IntGrid, fits_bits, symmetric_codes, target_scales

log = logging.getLogger("ktconvert")

CPU_GROUPS = (128, 64, 32)          # what --method auto may pick, largest first (fewest scales)


def quant_format(src, name: str):
    """The source's WeightFormat of tensor `name`, or None (plain float tensor, or a source without formats)."""
    f = getattr(src, "quant_format", None)
    return f(name) if f is not None else None


def int_grid(src, name: str) -> IntGrid | None:
    f = getattr(src, "int_grid", None)
    return f(name) if f is not None else None


# --- routed experts: the CPU layouts -----------------------------------------------------------------------------

def cpu_scales_ok(scales: np.ndarray, bits: int, group_size: int, scale_dtype: str = UNDECLARED_SCALE_DTYPE) -> bool:
    """Whether the CPU expert layout stores these scale values unchanged (its own pack/unpack of scales in
    `scale_dtype`: f32 = layout version 1, f16 / bf16 = version 2)."""
    n, ng = scales.shape
    if not scales_representable(scales, scale_dtype):
        return False              # pack_scales would round them (or, for float16, overflow)
    geom = MatrixGeometry(n, ng * group_size, bits, group_size, scale_dtype)
    padded = np.zeros((geom.n_pad, geom.n_groups), dtype=np.float32)
    padded[:n, :ng] = scales
    back = unpack_scales(pack_scales(padded, geom), geom)[:n, :ng]
    return bool(np.array_equal(back, scales.astype(back.dtype)) and np.array_equal(back.astype(np.float32), scales))


def expert_codes(src, names: dict[str, str], bits: int, group_size: int, scale_dtype: str = UNDECLARED_SCALE_DTYPE
                 ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]] | None, str, str]:
    """{proj: (codes (N, K) uint8, scales (N, K/G) float32)} of one expert taken over exactly into int`bits` with
    groups of `group_size`, or None; plus why not (empty when exact) and what the source format is."""
    formats = {p: quant_format(src, n) for p, n in names.items()}
    what = next((f.label for f in formats.values() if f is not None), "")
    if not expert_format_of_bits(bits).quantized:
        return None, f"the {expert_format_of_bits(bits).name} layout holds no integer codes", what
    if group_size == GROUP_PER_ROW:
        return None, "per-row scales are computed per NUMA shard", what
    if any(f is None or f.kind not in ("int", "mxfp4") for f in formats.values()):
        return None, "not an integer grid", what
    out = {}
    for p, n in names.items():
        grid = int_grid(src, n)
        if grid is None:
            return None, "not an integer grid", what
        got, why = symmetric_codes(grid, bits, group_size)
        if got is None:
            return None, why, grid.what
        if not cpu_scales_ok(got[1], bits, group_size, scale_dtype):
            as_what = "" if scale_dtype == UNDECLARED_SCALE_DTYPE else f" as {scale_dtype} (--scale-dtype)"
            return None, "the layout cannot store the source's scale values unchanged" + as_what, grid.what
        out[p] = got
        what = grid.what
    return out, "", what


def _cpu_group_for(fmt, hidden: int, intermediate: int) -> int | None:
    """The largest CPU group (32 or a multiple of 64) holding the source's groups exactly on both K's."""
    for g in CPU_GROUPS:
        if hidden % g or intermediate % g:
            continue
        if fmt.group > 0 and fmt.group % g:           # each of our groups inside one source group
            continue
        return g
    return None


def choose_method(src) -> tuple[str, int, str]:
    """--method auto: (method, group size, why). The exact target of the routed experts' source format when there
    is one (int4 codes stay int4; asymmetric int4, int8 and MXFP4 fit int8), else int4-amx with group 128."""
    a = src.arch
    layers = a.moe_layers()
    names = [a.expert_tensor_name(layers[0], 0, p) for p in ("gate", "up", "down")] if layers else []
    fmts = [quant_format(src, n) for n in names]
    default = (INT4.method, 128)
    if not fmts or any(f is None for f in fmts):
        return (*default, "the routed experts are not quantized in the source")
    f = fmts[0]
    if any(x != f for x in fmts) or f.act_order:
        return (*default, f"the experts' formats ({f.label}) have no one exact target")
    if f.kind == "mxfp4":
        bits, group = 8, (32 if a.hidden_size % 32 == 0 and a.moe_intermediate_size % 32 == 0 else None)
    elif f.kind == "int":
        bits = f.bits if f.symmetric else 2 * f.bits
        group = _cpu_group_for(f, a.hidden_size, a.moe_intermediate_size)
    else:
        return (*default, f"{f.label} is not an integer grid: re-quantized")
    try:
        fmt = expert_format_of_bits(bits)
    except LayoutError:
        fmt = None
    if fmt is None or not fmt.quantized or group is None:
        return (*default, f"no CPU layout holds {f.label} exactly")
    return fmt.method, group, f"exact target of {f.label}"


# --- GPU layers ----------------------------------------------------------------------------------------------------

def gpu_codes(grid: IntGrid, fmt, geom, group_size: int, keep_g_idx: bool = False) -> tuple[tuple | None, str]:
    """(codes (K, N) uint8, scales (n_groups, N) float16, g_idx (K,) int32) of a quantized Linear in GPU format
    `fmt` (a ktlayouts.gpu_formats format) with stored geometry `geom` (zero-padded for Marlin), holding the grid
    exactly; or (None, why not). keep_g_idx: act-order groups may be kept as they are (a format storing g_idx,
    written with --gpu-act-order so its quantization_config says desc_act)."""
    n, k = grid.shape
    ok, why = fits_bits(grid, fmt.bits)
    if not ok:
        return None, why
    glen = k if group_size == -1 else group_size
    scales, why = target_scales(grid, glen) if k % glen == 0 else (None, f"K={k} is not a multiple of {glen}")
    g_idx = None
    if scales is None:
        # act order: a format that stores g_idx keeps the source's permuted groups as they are
        if not (keep_g_idx and fmt.stores_g_idx and (geom.n, geom.k) == (n, k) and grid.scales.shape[1] == k // glen):
            return None, why
        scales, g_idx = grid.scales, grid.g_idx.astype(np.int32)
    s16 = scales.astype(np.float16)
    if not np.array_equal(s16.astype(np.float32), scales):
        return None, "the source's scales are not float16 values (GPU formats store float16 scales)"
    z = 1 << (fmt.bits - 1)
    codes = np.full((geom.k, geom.n), z, dtype=np.uint8)
    codes[:k, :n] = (grid.q.T + z).astype(np.uint8)
    sc = np.zeros(geom.scales_shape, dtype=np.float16)
    sc[: scales.shape[1], :n] = s16.T
    return (codes, sc, geom.default_g_idx() if g_idx is None else g_idx), ""


# --- the log ---------------------------------------------------------------------------------------------------

@dataclass
class _Tally:
    exact: int = 0
    exact_from: set = field(default_factory=set)
    requantized: int = 0
    reasons: dict = field(default_factory=dict)         # why -> count
    worst: tuple = (0.0, "")                            # (relative error, tensor)


class PathLog:
    """Which path every tensor of a quantized source took, per part ("experts", "GPU layers"), thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.total: dict[str, _Tally] = {}
        self.layer: dict[tuple, _Tally] = {}

    def _add(self, key, exact: bool, what: str, why: str, err: float, name: str) -> None:
        for t in (self.total.setdefault(key[0], _Tally()), self.layer.setdefault(key, _Tally())):
            if exact:
                t.exact += 1
                t.exact_from.add(what)
            else:
                t.requantized += 1
                t.reasons[f"{what}: {why}" if what else why] = t.reasons.get(f"{what}: {why}" if what else why,
                                                                             0) + 1
                t.worst = max(t.worst, (err, name))

    def exact(self, part: str, layer, name: str, what: str) -> None:
        with self._lock:
            self._add((part, layer), True, what, "", 0.0, name)

    def requantized(self, part: str, layer, name: str, what: str, why: str, err: float) -> None:
        with self._lock:
            self._add((part, layer), False, what, why, err, name)

    @staticmethod
    def _line(t: _Tally, target: str) -> str:
        parts = []
        if t.exact:
            parts.append(f"{t.exact} taken over exactly from {', '.join(sorted(t.exact_from))} (codes and scales "
                         f"copied, no float round trip, error 0)")
        if t.requantized:
            why = "; ".join(f"{r} ({c})" for r, c in sorted(t.reasons.items()))
            parts.append(f"{t.requantized} dequantized and re-quantized to {target} [{why}], max relative error "
                         f"{t.worst[0]:.4g} ({t.worst[1]})")
        return "; ".join(parts)

    def layer_line(self, part: str, layer, target: str) -> str | None:
        t = self.layer.get((part, layer))
        return None if t is None else f"layer {layer} {part}: {self._line(t, target)}"

    def summary(self, targets: dict[str, str]) -> list[str]:
        return [f"{part}: {self._line(t, targets.get(part, ''))}" for part, t in self.total.items()]

    def any(self) -> bool:
        return bool(self.total)


def relative_error(approx: np.ndarray, ref: np.ndarray) -> float:
    ref64 = np.asarray(ref, dtype=np.float64)
    num = float(np.linalg.norm(np.asarray(approx, dtype=np.float64) - ref64))
    den = float(np.linalg.norm(ref64))
    return num / den if den else (0.0 if num == 0 else float("inf"))
