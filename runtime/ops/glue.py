"""ktrun.ops.glue: the decode step's float32 glue in single libktkernels calls on the calling thread, bit-identical to
the torch ops they replace: RMSNorm rows, optionally after a residual add (kt_rms_norm, torch's CPU F.rms_norm), and
the rotary embedding (kt_rope, ktrun.models.layers.Rope.apply's elementwise formula). And one op that is not
torch's bits: MLA's absorbed decode attention core (kt_mla_attend) and the sigmoid router of a few tokens
(kt_route_sigmoid), below.

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

import contextlib
import ctypes

import torch
import torch.nn.functional as F

from .float_linear import DTYPES as WEIGHT_DTYPES
from .library import GqaDecodeArgs, GqaLayerArgs, KernelError, MlaDecodeArgs, MoeDecodeArgs, load_library

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
            and norm_lanes() > 0)


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


# Attention scores (heads x positions) up to which mla_attend runs on the calling thread alone (no pool); a longer
# context keeps torch's GEMMs on its threads (as layers.serial_torch's limit for the same GEMMs). On a pool the
# kernels take any length: the heads split between the workers and a long cache in chunks merged in order (ABI 17).
MLA_ATTEND_MAX_SCORES = 16384


def mla_attend_supported(lats: list[torch.Tensor], R: int, nh: int, pooled: bool = False) -> bool:
    """Whether mla_attend() takes one request's decode row of nh heads (q_lat (nh, R) and the roped q_rot (nh, dr)
    float32 with contiguous last dims): its cache runs float32 CPU (S_r, R + dr) views with one row stride and
    contiguous rows, R and dr multiples of 16, the library loaded, and on the calling thread alone (pooled False)
    nh x S within MLA_ATTEND_MAX_SCORES."""
    if not lats or R % 16 or _library() is None:
        return False
    dr, S = lats[0].shape[-1] - R, 0
    for lat in lats:
        if lat.dtype != torch.float32 or not lat.is_cpu or lat.dim() != 2 or lat.shape[-1] != R + dr or \
                lat.stride(-1) != 1 or (lat.shape[0] > 1 and lat.stride(0) != lats[0].stride(0)):
            return False
        S += lat.shape[0]
    return dr >= 0 and dr % 16 == 0 and 0 < nh * S and (pooled or nh * S <= MLA_ATTEND_MAX_SCORES)


def _check_queries(what: str, q_lat: torch.Tensor, q_rot: torch.Tensor) -> None:
    if q_rot.dtype != torch.float32 or q_lat.dtype != torch.float32 or (q_rot.numel() and q_rot.stride(-1) != 1):
        raise KernelError(f"{what}: q_lat {q_lat.dtype}, q_rot {q_rot.dtype}: float32 rows with a contiguous last "
                          "dim expected")


def mla_attend(q_lat: torch.Tensor, q_rot: torch.Tensor, lats: list[torch.Tensor], scale: float, out: torch.Tensor,
               kernels=None) -> None:
    """MLA's absorbed decode attention for one query row per head (ktrun.models.attention, absorbed form), into out
    (nh, R) float32 (contiguous last dim): scores (q_lat[h] . c_j + q_rot[h] . k_rot_j) * scale over the cached rows
    [c_j | k_rot_j] of lats (position order), softmax, out[h] = sum_j p[h, j] c_j. For mla_attend_supported inputs.
    kernels: a MoEKernels context whose pool splits the heads (the caller one of its workers; returns when done),
    else the calling thread alone.

    Not torch's bits: torch ran this as two MKL GEMMs, a softmax and ~10 small ops (~300 us per MLA layer in a
    decode step, while the kernel pool waited). The kernel (kernels/src/mla_attend.cpp) sums in one fixed order per
    head on every ISA, so a request's result depends only on its own row and cache: the same whatever the batch, the
    cache's block runs or the threads, which is what batch invariance needs."""
    n = len(lats)
    ptrs = (ctypes.c_void_p * n)(*[lat.data_ptr() for lat in lats])
    lens = (ctypes.c_int64 * n)(*[lat.shape[0] for lat in lats])
    R, dr = q_lat.shape[-1], q_rot.shape[-1]
    _check_queries("kt_mla_attend", q_lat, q_rot)
    row_stride = next((lat.stride(0) for lat in lats if lat.shape[0] > 1), R + dr)
    if _library().kt_mla_attend(None if kernels is None else kernels.handle, q_lat.shape[0], R, dr,
                                q_lat.data_ptr(), q_lat.stride(0), q_rot.data_ptr(), q_rot.stride(0), scale, n, ptrs,
                                lens, row_stride, out.data_ptr(), out.stride(0)) != 0:
        raise KernelError(f"kt_mla_attend: bad arguments (q_lat {tuple(q_lat.shape)}, q_rot {tuple(q_rot.shape)}, "
                          f"runs {[tuple(lat.shape) for lat in lats]})")


def mla_attend_batch(q_lat: torch.Tensor, q_rot: torch.Tensor, lats: list[list[torch.Tensor]], scale: float,
                     out: torch.Tensor, kernels=None) -> bool:
    """mla_attend for m requests in one call (one job on the pool: a decode step of m requests made m pool round
    trips per MLA layer, most of the step at 16 requests): q_lat (m, nh, R), q_rot (m, nh, dr), out (m, nh, R)
    float32 with contiguous last dims; lats[i] request i's runs, each request as mla_attend_supported takes it.
    Every head gets the bits mla_attend gives it alone. False (nothing done) when the requests' cache rows do not
    share one row stride."""
    m = len(lats)
    strides = {lat.stride(0) for runs in lats for lat in runs if lat.shape[0] > 1}
    if m == 0 or len(strides) > 1:
        return False
    R, dr = q_lat.shape[-1], q_rot.shape[-1]
    _check_queries("kt_mla_attend_batch", q_lat, q_rot)
    flat = [lat for runs in lats for lat in runs]
    n_runs = (ctypes.c_int64 * m)(*[len(runs) for runs in lats])
    ptrs = (ctypes.c_void_p * len(flat))(*[lat.data_ptr() for lat in flat])
    lens = (ctypes.c_int64 * len(flat))(*[lat.shape[0] for lat in flat])
    if _library().kt_mla_attend_batch(None if kernels is None else kernels.handle, m, q_lat.shape[1], R, dr,
                                      q_lat.data_ptr(), q_lat.stride(0), q_lat.stride(1), q_rot.data_ptr(),
                                      q_rot.stride(0), q_rot.stride(1), scale, n_runs, ptrs, lens,
                                      strides.pop() if strides else R + dr, out.data_ptr(), out.stride(0),
                                      out.stride(1)) != 0:
        raise KernelError(f"kt_mla_attend_batch: bad arguments (q_lat {tuple(q_lat.shape)}, q_rot "
                          f"{tuple(q_rot.shape)}, {m} requests)")
    return True


def gqa_attend_batch(q: torch.Tensor, entries: list[list[tuple[torch.Tensor, torch.Tensor]]], scale: float,
                     out: torch.Tensor, kernels=None) -> bool:
    """GQA / MQA attention of m query rows in one call (kt_gqa_attend_batch: one job on the pool of kernels, a
    MoEKernels / LinearKernels context, else the calling thread): q (m, nh, hd) and out (m, nh, vd) float32 CPU with
    contiguous heads; entries[e]: query row e's cache runs in position order, each (k (S_r, nkv, hd), v (S_r, nkv, vd))
    float32 CPU views with contiguous heads. Head h reads kv head h // (nh / nkv): out[e, h] = softmax_j(q[e, h] .
    k_j * scale) . v_j, in one fixed order on every ISA (kernels/src/mla_attend.cpp), so a row's bits depend on its
    own query and positions only. False (nothing done) for anything else: other dtypes or devices, strided heads,
    runs whose rows do not share one stride, hd / vd not multiples of 16, the library missing."""
    m, nh, hd = q.shape
    vd = out.shape[-1]
    flat = [run for runs in entries for run in runs]
    if not m or len(entries) != m or not flat or hd % 16 or vd % 16 or _library() is None:
        return False
    nkv = flat[0][0].shape[1]
    if nh % nkv or any(len(runs) == 0 for runs in entries):
        return False
    for t, width in ((q, hd), (out, vd)):
        if t.dtype != torch.float32 or not t.is_cpu or t.stride(-1) != 1 or t.shape[:2] != (m, nh) or \
                t.shape[-1] != width:
            return False
    k_stride = next((k.stride(0) for k, _ in flat if k.shape[0] > 1), nkv * hd)    # one row stride for all runs
    v_stride = next((v.stride(0) for _, v in flat if v.shape[0] > 1), nkv * vd)
    for k, v in flat:
        for t, width, stride in ((k, hd, k_stride), (v, vd, v_stride)):
            if t.dtype != torch.float32 or not t.is_cpu or t.dim() != 3 or t.shape[1:] != (nkv, width) or \
                    t.stride(2) != 1 or t.stride(1) != width or (t.shape[0] > 1 and t.stride(0) != stride) or \
                    stride < nkv * width:
                return False
    n_runs = (ctypes.c_int64 * m)(*[len(runs) for runs in entries])
    kp = (ctypes.c_void_p * len(flat))(*[k.data_ptr() for k, _ in flat])
    vp = (ctypes.c_void_p * len(flat))(*[v.data_ptr() for _, v in flat])
    lens = (ctypes.c_int64 * len(flat))(*[k.shape[0] for k, _ in flat])
    if _library().kt_gqa_attend_batch(None if kernels is None else kernels.handle, m, nkv, nh // nkv, hd, vd,
                                      q.data_ptr(), q.stride(0), q.stride(1), scale, n_runs, kp, vp, lens, k_stride,
                                      v_stride, out.data_ptr(), out.stride(0), out.stride(1)) != 0:
        raise KernelError(f"kt_gqa_attend_batch: bad arguments (q {tuple(q.shape)}, out {tuple(out.shape)}, {m} rows)")
    return True


def norm_lanes() -> int:
    """The vector width kt_rms_norm sums in to match torch's (8 or 16; 0: no library)."""
    return _state.get("lanes") or _lanes()


def norm_weights_ok(*weights: torch.Tensor | None) -> bool:
    """Whether kt_rms_norm can norm rows with these weights as ktrun.models.layers.rms_norm does: float32 contiguous
    CPU weights of 16 .. MAX_D floats, the library's sum matching torch's."""
    return all(t is not None and t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()
               and 16 <= t.numel() <= MAX_D for t in weights) and norm_lanes() > 0


def _set_norms(a: GqaDecodeArgs, norm: str | None, q_w: torch.Tensor | None, k_w: torch.Tensor | None,
               eps: float) -> None:
    """kt_gqa_decode_args' q / k norm fields (gqa_decode's norm, q_w, k_w, eps)."""
    a.norm = {None: 0, "head": 1, "projection": 2}[norm]
    a.lanes = norm_lanes() if norm else 0
    a.eps = eps
    a.q_norm = q_w.data_ptr() if norm else None
    a.k_norm = k_w.data_ptr() if norm else None


def _set_rows(a: GqaDecodeArgs, T: int, cos: torch.Tensor, sin: torch.Tensor, rope_half: int, interleaved: bool,
              paging: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None) -> None:
    """kt_gqa_decode_args' fields of one call (gqa_decode's arguments of those names): the rows, their RoPE, the
    requests' block tables, the layer's caches and the window."""
    a.T, a.rope_half, a.interleaved = T, rope_half, int(interleaved)
    a.cos, a.sin, a.cs_stride = (cos.data_ptr(), sin.data_ptr(), cos.stride(0)) if rope_half else (None, None, 0)
    a.m, row0, start, table0, tables = paging
    a.row0, a.start, a.table0, a.tables = row0.data_ptr(), start.data_ptr(), table0.data_ptr(), tables.data_ptr()
    a.block_size, a.k_cache, a.k_block_stride, a.k_row_stride = \
        k_cache.shape[1], k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1)
    a.v_cache, a.v_block_stride, a.v_row_stride = v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1)
    a.window = window or 0


def gqa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nh: int, hd: int, norm: str | None,
               q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
               rope_half: int, interleaved: bool, paging: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, window: int | None, kernels=None) -> torch.Tensor:
    """A GQA layer's new rows in one kt_gqa_decode call (on the pool of kernels, a MoEKernels / LinearKernels context,
    else the calling thread): q (T, nh * hd), k (T, nkv * hd), v (T, nkv * vd) as projected, float32 CPU rows with
    contiguous heads; norm None / "head" / "projection" with weights q_w, k_w (norm_weights_ok); RoPE of the
    first 2 * rope_half dims of each head with cos / sin (T, rope_half) float32 rows (rope_half 0: none); paging:
    (m, row0 (m + 1), start (m), table0 (m + 1), tables) int64 CPU tensors, the requests' rows, first positions and
    block tables; k_cache / v_cache: this layer's (blocks, block_size, nkv, hd / vd) float32 slabs. Writes each row's
    k / v into its slot and -> the attention output (T, nh * vd): for every row the bits of q/k norm, RoPE, cache
    write and kt_gqa_attend_batch done one after another."""
    T = q.shape[0]
    nkv, vd = k_cache.shape[2], v_cache.shape[3]
    out = torch.empty((T, nh * vd), dtype=torch.float32)
    a = GqaDecodeArgs(nh=nh, nkv=nkv, hd=hd, vd=vd, q=q.data_ptr(), q_stride=q.stride(0), k=k.data_ptr(),
                      k_stride=k.stride(0), v=v.data_ptr(), v_stride=v.stride(0), scale=scale, out=out.data_ptr(),
                      out_stride=nh * vd)
    _set_norms(a, norm, q_w, k_w, eps)
    _set_rows(a, T, cos, sin, rope_half, interleaved, paging, k_cache, v_cache, window)
    lib = _library()
    if lib.kt_gqa_decode(None if kernels is None else kernels.handle, ctypes.byref(a)) != 0:
        raise KernelError(lib.kt_last_error().decode())
    return out


class GqaLayerCall:
    """kt_gqa_layer for one GQA layer: a GQA layer's decode rows from its normed input x to o_proj's output in one
    call on the pool of kernels (a LinearKernels context holding the q / k / v / o Linears). The layer's constant
    arguments (geometry, Linear ids, biases, norms, scale) are set once here; a call fills in the rows, their RoPE,
    the tables, the caches and the window (_set_rows, as gqa_decode). Per call the argument block is this one, filled
    in place: building the ~50 ctypes fields anew cost more than the C call's own glue (~20 us of a ~100 us call on
    a 2-core Zen 3). Not thread-safe (one forward at a time per model, as the engine runs them).

    ids: {"q", "k", "v", "o"} Linear ids; biases: the same keys -> float32 contiguous tensors or None; norm, q_w, k_w,
    eps, scale as gqa_decode's; n_out: o_proj's N."""

    def __init__(self, nh: int, nkv: int, hd: int, vd: int, ids: dict, biases: dict, norm: str | None,
                 q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float, scale: float, n_out: int, kernels):
        self.kernels, self.n_out = kernels, n_out
        self._keep = (biases, q_w, k_w)             # the pointers below stay valid while the plan lives
        # the block pool's tokens list whose slabs the block's cache fields point into, as a decode step's one call
        # (ktrun.models.step_one_call) left them; a call here sets them and clears this
        self.caches_of = None
        a = self.args = GqaLayerArgs()
        g = a.attn
        g.nh, g.nkv, g.hd, g.vd, g.scale = nh, nkv, hd, vd, scale
        _set_norms(g, norm, q_w, k_w, eps)
        a.q_id, a.k_id, a.v_id, a.o_id = ids["q"], ids["k"], ids["v"], ids["o"]
        for key in ("q", "k", "v", "o"):
            b = biases.get(key)
            setattr(a, key + "_bias", None if b is None else b.data_ptr())
        a.n_out = n_out

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, paging: tuple,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None) -> torch.Tensor:
        """x (T, K) float32 CPU rows with contiguous columns; cos / sin (T, rope_half) (rope_half 0: none),
        interleaved, paging, k_cache / v_cache, window as gqa_decode's -> o_proj's output (T, n_out), the layer's
        k / v written into the caches."""
        T = x.shape[0]
        out = torch.empty((T, self.n_out), dtype=torch.float32)
        a = self.args
        _set_rows(a.attn, T, cos, sin, cos.shape[-1], interleaved, paging, k_cache, v_cache, window)
        self.caches_of = None
        a.x, a.x_stride = x.data_ptr(), x.stride(0) if T > 1 else x.shape[1]
        a.out, a.out_stride = out.data_ptr(), self.n_out
        lib = _library()
        if lib.kt_gqa_layer(self.kernels.handle, ctypes.byref(a)) != 0:
            raise KernelError(lib.kt_last_error().decode())
        return out


class MlaLayerCall:
    """kt_mla_decode for one MLA layer on the pool of kernels (a MoEKernels context holding every Linear), its
    constant arguments set once in an argument block filled in place per call, as GqaLayerCall does for GQA:
    linears, the Linear ids {"q_a", "kv_a", "q_b", "o", "uk", "kv_b"} ("q_a" is q_proj's when q_lora is 0); dims
    (nh, dn, dr, dv, R, q_lora, q_b's input width: q_lora or more, zero-padded); W_uk's input scaling uk_scale
    (nh * R / uk_group, dn) float32; the norms' weights (q_a_norm None when q_lora is 0), eps, the softmax scale and
    o_proj's N. Not thread-safe (one forward at a time per model, as the engine runs them)."""

    def __init__(self, linears: dict, dims: tuple, uk_group: int, uk_scale: torch.Tensor,
                 q_a_norm: torch.Tensor | None, kv_a_norm: torch.Tensor, eps: float, scale: float, n_out: int,
                 kernels):
        self.kernels, self.n_out, self.dims = kernels, n_out, dims
        self._keep = (uk_scale, q_a_norm, kv_a_norm)   # the pointers below stay valid while the call lives
        self.caches_of = None        # as GqaLayerCall's: the pool's tokens list the cache fields point into
        nh, dn, dr, dv, R, q_lora, q_b_k = dims
        self.args = MlaDecodeArgs(0, nh, dn, dr, dv, R, q_lora, q_b_k, None, 0, linears["q_a"], linears["kv_a"],
                                  linears.get("q_b", -1), linears["o"], linears["uk"], linears["kv_b"], uk_group,
                                  uk_scale.data_ptr(), None if q_a_norm is None else q_a_norm.data_ptr(),
                                  kv_a_norm.data_ptr(), eps, norm_lanes(), None, None, 0, 0, 0,
                                  None, None, None, None, 0, None, 0, 0, scale, None, n_out)

    def set_cache(self, cache: torch.Tensor) -> None:
        """This layer's (blocks, block_size, R + dr) float32 slab."""
        a = self.args
        a.block_size, a.cache, a.block_stride, a.row_stride = \
            cache.shape[1], cache.data_ptr(), cache.stride(0), cache.stride(1)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, paging: tuple,
                 cache: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) float32 CPU with contiguous rows; cos / sin (T, dr / 2) float32 rows; paging as
        gqa_decode's; cache: this layer's (blocks, block_size, R + dr) float32 slab. Writes each row's latent into its
        slot and -> o_proj's output (T, n_out): the bits of mla_attention's steps on the kernels
        (kernels/src/mla_decode.cpp)."""
        T = x.shape[0]
        out = torch.empty((T, self.n_out), dtype=torch.float32)
        a = self.args
        a.T, a.x, a.x_stride = T, x.data_ptr(), x.stride(0)
        a.cos, a.sin, a.cs_stride, a.interleaved = cos.data_ptr(), sin.data_ptr(), cos.stride(0), int(interleaved)
        a.m, row0, start, table0, tables = paging
        a.row0, a.start, a.table0, a.tables = row0.data_ptr(), start.data_ptr(), table0.data_ptr(), tables.data_ptr()
        self.set_cache(cache)
        self.caches_of = None
        a.out, a.out_stride = out.data_ptr(), self.n_out
        lib = _library()
        if lib.kt_mla_decode(self.kernels.handle, ctypes.byref(a)) != 0:
            raise KernelError(lib.kt_last_error().decode())
        return out

def moe_decode(x: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor, next_norm: torch.Tensor, eps: float,
               router: tuple, layer: int, shared: int | None, kernels, finish: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, tuple, float, torch.Tensor | None]:
    """A MoE layer's few rows in one kt_moe_decode call on kernels (a MoEKernels context holding the layer's experts):
    x, delta (T, H) float32 CPU rows with contiguous last dims (the residual stream and the attention's output);
    norm / next_norm: the post-attention and the next RMSNorm's weights (norm_weights_ok); router: ("sigmoid", gate,
    bias, n_group, topk_group, top_k, renorm, scaling) or ("softmax", gate, None, ...), gate (E, H) float32 or
    bfloat16, contiguous; shared: the fused shared expert's layer id. -> (x + delta + experts, its next norm,
    (ids (T, top_k) int64, weights (T, top_k) float32), seconds waiting for the experts, None), the bits of
    add_rms_norm, route_sigmoid / route_softmax (on the pool), the experts' job and add_rms_norm called one after
    another. finish False: return once the experts' job is submitted -> (x + delta, its norm (the job's input), the choice, 0,
    the experts' sum as the job writes it): read it after kernels.sync() (or another job's submit)."""
    T, H = x.shape
    kind, gate, bias, n_group, topk_group, top_k, renorm, scaling = router
    x_out, h_out = torch.empty((T, H), dtype=torch.float32), torch.empty((T, H), dtype=torch.float32)
    e = None if finish else torch.empty((T, H), dtype=torch.float32)
    ids, wts = torch.empty((T, top_k), dtype=torch.int64), torch.empty((T, top_k), dtype=torch.float32)
    a = MoeDecodeArgs(T, H, x.data_ptr(), x.stride(0) if T > 1 else H, delta.data_ptr(),
                      delta.stride(0) if T > 1 else H, norm.data_ptr(), next_norm.data_ptr(), eps,
                      norm_lanes(), 0 if kind == "sigmoid" else 1, gate.data_ptr(), gate.shape[0],
                      None if bias is None else bias.data_ptr(), WEIGHT_DTYPES[gate.dtype], n_group, topk_group,
                      top_k, int(renorm), scaling,
                      layer, -1 if shared is None else shared, int(finish), x_out.data_ptr(), h_out.data_ptr(),
                      None if e is None else e.data_ptr(), ids.data_ptr(), wts.data_ptr(), 0.0)
    lib = _library()
    if lib.kt_moe_decode(kernels.handle, ctypes.byref(a)) != 0:
        raise KernelError(lib.kt_last_error().decode())
    if not finish:
        kernels.hold((x_out, h_out, e, ids, wts))       # the job in flight reads and writes them until it ends
    return x_out, h_out, (ids, wts), a.wait_s, e



ROUTER_KINDS = {"sigmoid": 0, "softmax": 1, "dense": 2}   # kt_moe_decode_args.router (dense: no gate, one expert)


class MoeDecodeCall:
    """kt_moe_decode for one MoE layer's decode rows (finish on): the layer's constant arguments (norms, eps, router,
    layer ids, the norm lanes) set once in an argument block filled in place per call, as GqaLayerCall does, and the
    router's choice written to buffers kept here (a step does not read it). moe_decode() built the ~30 fields, five
    tensors and the router tuple's unpacking anew every call: ~30 us of Python per MoE layer in the Qwen3-30B-A3B-
    shaped decode step on 2 Zen 3 cores. The same call, the same bits. Not thread-safe (one forward at a time per
    model, as the engine runs them).

    norm / next_norm: float32 contiguous weights (norm_weights_ok); router, layer, shared: moe_decode's, or router
    ("dense", None, None, 1, 1, 1, False, 1.0) for a dense layer's MLP registered as one-expert layer `layer`
    (KernelExperts.fuse_dense: every row's expert 0 at weight 1); max_rows: the most rows a call takes
    (ROUTE_MAX_ROWS)."""

    def __init__(self, norm: torch.Tensor, next_norm: torch.Tensor, eps: float, router: tuple, layer: int,
                 shared: int | None, kernels, max_rows: int):
        kind, gate, bias, n_group, topk_group, top_k, renorm, scaling = router
        self.norm, self.next_norm, self.kernels, self.max_rows = norm, next_norm, kernels, max_rows
        self.H = norm.numel()
        self._keep = (gate, bias)                    # the pointers below stay valid while the call lives
        self._ids = torch.empty((max_rows, top_k), dtype=torch.int64)
        self._wts = torch.empty((max_rows, top_k), dtype=torch.float32)
        self.args = MoeDecodeArgs(0, self.H, None, self.H, None, self.H, norm.data_ptr(), next_norm.data_ptr(), eps,
                                  norm_lanes(), ROUTER_KINDS[kind],
                                  None if gate is None else gate.data_ptr(), 1 if gate is None else gate.shape[0],
                                  None if bias is None else bias.data_ptr(),
                                  0 if gate is None else WEIGHT_DTYPES[gate.dtype], n_group, topk_group,
                                  top_k, int(renorm), scaling, layer, -1 if shared is None else shared, 1, None,
                                  None, None, self._ids.data_ptr(), self._wts.data_ptr(), 0.0)
        self._lib = _library()

    def __call__(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """x, delta (T, H) float32 CPU rows with contiguous last dims, T <= max_rows -> (x + delta + experts, its
        next norm, seconds waiting for the experts): moe_decode's with finish on. The two outputs are the halves
        of one new (2, T, H) tensor."""
        T, H = x.shape
        out = torch.empty((2, T, H), dtype=torch.float32)
        a = self.args
        a.T = T
        a.x, a.x_stride = x.data_ptr(), x.stride(0) if T > 1 else H
        a.delta, a.delta_stride = delta.data_ptr(), delta.stride(0) if T > 1 else H
        p = out.data_ptr()
        a.x_out, a.h_out = p, p + 4 * T * H
        if self._lib.kt_moe_decode(self.kernels.handle, ctypes.byref(a)) != 0:
            raise KernelError(self._lib.kt_last_error().decode())
        return out[0], out[1], a.wait_s


@contextlib.contextmanager
def routers_on(kernels):
    """Inside the block route_sigmoid / route_softmax compute a large gate's logits on the pool of kernels (a MoEKernels
    context; None: the calling thread), its experts' rows split between the workers: the same bits (each expert's
    dot products are computed whole by one worker). MoEModel scopes its routers' calls so; the router functions keep
    their arguments whatever the family."""
    before = _state.get("router_kernels")
    _state["router_kernels"] = kernels
    try:
        yield
    finally:
        _state["router_kernels"] = before


def _router_handle():
    k = _state.get("router_kernels")
    return None if k is None else k.handle


# tokens up to which the routers run here: decode batches of many requests and speculative verifies (a gate's
# rows are read once for all T, kernels/src/router.cpp); a prompt's GEMM stays torch's
ROUTE_MAX_ROWS = 32


def route_sigmoid_supported(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether route_sigmoid() takes x (T, K): float32 CPU rows (contiguous last dim) of T <= ROUTE_MAX_ROWS tokens,
    gate_w (E, K) float32 or bfloat16 (the checkpoint's, as the CPU loader keeps it: widened exactly in the dot
    products, the bits of its float32 copy) and bias (E,) float32, CPU and contiguous, K a multiple of 16, the library
    loaded."""
    return (x.dim() == 2 and 0 < x.shape[0] <= ROUTE_MAX_ROWS and x.dtype == torch.float32 and x.is_cpu
            and x.stride(-1) == 1 and gate_w.dtype in WEIGHT_DTYPES and gate_w.is_cpu and gate_w.is_contiguous()
            and gate_w.dim() == 2 and gate_w.shape[1] == x.shape[1] and x.shape[1] % 16 == 0
            and (bias is None or (bias.dtype == torch.float32 and bias.is_cpu and bias.is_contiguous()
                                  and bias.numel() == gate_w.shape[0]))
            and _library() is not None)


def route_sigmoid(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, n_group: int, topk_group: int,
                  top_k: int, norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ktrun.models.routing.sigmoid_grouped for route_sigmoid_supported inputs, in one call: -> ids (T, top_k)
    int64 (best first), weights (T, top_k) float32.

    Not torch's bits: torch's router was an MKL GEMV and ~12 small ops (~140 us per MoE layer in a decode step, the
    kernel pool waiting). The logits here sum in one fixed order on every ISA (kernels/src/router.cpp), so a token's
    choice depends on its own row only; ties go to the lower index."""
    T, E = x.shape[0], gate_w.shape[0]
    ids = torch.empty((T, top_k), dtype=torch.int64)
    wts = torch.empty((T, top_k), dtype=torch.float32)
    x_stride = x.stride(0) if T > 1 else x.shape[1]
    if _library().kt_route_sigmoid(_router_handle(), T, E, x.shape[1], x.data_ptr(), x_stride, gate_w.data_ptr(),
                                   WEIGHT_DTYPES[gate_w.dtype], gate_w.shape[1],
                                   None if bias is None else bias.data_ptr(),
                                   n_group, topk_group, top_k, int(norm), scaling, ids.data_ptr(),
                                   wts.data_ptr()) != 0:
        raise KernelError(f"kt_route_sigmoid: bad arguments (x {tuple(x.shape)}, gate {tuple(gate_w.shape)}, groups "
                          f"{topk_group}/{n_group}, top_k {top_k})")
    return ids, wts


def route_softmax(x: torch.Tensor, gate_w: torch.Tensor, n_group: int, topk_group: int, top_k: int, norm: bool,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ktrun.models.routing.softmax_topk for route_sigmoid_supported inputs (no bias), in one call: -> ids (T, top_k)
    int64 (best first), weights (T, top_k) float32. Groups (topk_group < n_group) as group_limited_greedy: a group
    scores its best expert. Not torch's bits, for the reasons route_sigmoid gives (kernels/src/router.cpp)."""
    T, E = x.shape[0], gate_w.shape[0]
    ids = torch.empty((T, top_k), dtype=torch.int64)
    wts = torch.empty((T, top_k), dtype=torch.float32)
    x_stride = x.stride(0) if T > 1 else x.shape[1]
    if _library().kt_route_softmax(_router_handle(), T, E, x.shape[1], x.data_ptr(), x_stride, gate_w.data_ptr(),
                                   WEIGHT_DTYPES[gate_w.dtype], gate_w.shape[1], n_group, topk_group, top_k,
                                   int(norm), scaling, ids.data_ptr(), wts.data_ptr()) != 0:
        raise KernelError(f"kt_route_softmax: bad arguments (x {tuple(x.shape)}, gate {tuple(gate_w.shape)}, groups "
                          f"{topk_group}/{n_group}, top_k {top_k})")
    return ids, wts
