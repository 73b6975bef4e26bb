"""GPU-quantized Linears run on the CPU by libktkernels' dense Linear op (`--gpu-weights kernels`, the CPU default).

At load each quantized Linear of the conversion (Marlin, GPTQ, compressed-tensors; int4/int8; group 32, 64m or per
row) has its codes read (gptq / compressed-tensors words straight from the file; Marlin's unpacked to (K, N) bytes
first; no float weights) and repacked once, bit-exact, into cpu-linear-int4/int8 tiles (kt_linear_repack, layouts/README.md "CPU dense
Linears"): the same symmetric codes and groups, so nothing is re-quantized and no dense float copy is made. The
tiles are owned by the KernelLinear; the conversion's bytes are read once and released.

Padding: Marlin stores K and N zero-padded to its tiles; the op gets the logical N and K rounded up to the group
size (K_op <= stored K, the extra codes are the zero point, i.e. weight 0), so x is zero-padded to K_op when
they differ and y is exactly (T, N).

Act-order GPTQ (a permuted g_idx: channel k in group g_idx[k]) runs on the op too: sorting the input channels by
group (perm = stable argsort of g_idx) makes every group G consecutive channels, so the codes' rows are permuted once
at load and each call gathers x's columns by the same perm (y = x[:, perm] W[:, perm]^T, exact). Not through the op
(dequantized at load instead, said in the placement line): a g_idx whose groups are not G channels each, group
sizes the tiles cannot hold (not 32 / a multiple of 64 / per row). MLA's kv_b_proj is a KernelLinear too;
its absorbed per-head form (decode) runs on the op as well (AbsorbedKvB: kv_b's own tiles for W_uv, its codes
transposed once for W_uk), so no float copy of it is made either.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from ktlayouts.constants import GROUP_PER_ROW
from ktlayouts.cpu_expert import LayoutError, MatrixGeometry
from ktlayouts.cpu_linear import linear_geometry, unpack_linear, unpack_linear_codes
from ktlayouts.expert_formats import F16_SCALES
from ktlayouts.gptq import stored_scales, unpack_cols, unpack_rows, zero_point
from ktlayouts.gpu_formats import gpu_format, linear_parts, quantized_linears
from ktlayouts.marlin import unpack_scales as marlin_unpack_scales
from ktlayouts.marlin import weight_perm

from .linear import LinearKernels


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


class KernelLinear:
    """One quantized Linear y = x W^T (+ b), W (N, K), as cpu-linear tiles registered on a LinearKernels context."""

    def __init__(self, name: str, lin: LinearKernels, linear_id: int, n: int, k: int, k_op: int,
                 geom: MatrixGeometry, qweight: np.ndarray, scales: np.ndarray, dtype: torch.dtype,
                 perm: torch.Tensor | None = None):
        self.name, self.lin, self.id = name, lin, linear_id
        self.n, self.k, self.k_op, self.geom, self.dtype = n, k, k_op, geom, dtype
        self.qweight, self.scales = qweight, scales      # (N_pad/16, K_pad/64, tile) u8, (N_pad/16, n_groups, 16) f16/f32
        self.perm = perm                                 # act-order: (K,) int64, input channel order of the tiles

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def bits(self) -> int:
        return self.geom.bits

    @property
    def group_size(self) -> int:
        return self.geom.group_size

    @property
    def nbytes(self) -> int:
        """Bytes one pass over this Linear reads (tiles + scales)."""
        return self.qweight.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> W (N, K) from the tiles (for weights used other than as a matmul: MLA's absorbed kv_b)."""
        w = unpack_linear(self.qweight, self.scales, self.geom)[: self.n, : self.k]
        if self.perm is not None:                       # tile column j holds input channel perm[j]
            w_in = np.empty_like(w)
            w_in[:, self.perm.numpy()] = w
            w = w_in
        return torch.from_numpy(np.ascontiguousarray(w)).to(dtype or self.dtype)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.k)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        if self.k_op != self.k:
            x2 = F.pad(x2, (0, self.k_op - self.k))
        return x2 if x2.stride(-1) == 1 else x2.contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., K) on the CPU -> (..., N) in x's dtype."""
        return self.start(x, bias)()

    def start(self, x: torch.Tensor, bias: torch.Tensor | None = None):
        """Submit y = self(x, bias) and return a function that waits for the job and returns y: torch work between
        the two calls overlaps the job (the pool runs one job at a time: a later submit waits for this one)."""
        x2 = self._input(x)
        out = torch.empty((x2.shape[0], self.n), dtype=torch.float32)
        if x2.shape[0]:
            self.lin.submit_prepared((self.id,), x2, [out])

        def finish() -> torch.Tensor:
            if x2.shape[0]:
                self.lin.sync()
            y = out.reshape(*x.shape[:-1], self.n)
            y = y if x.dtype == torch.float32 else y.to(x.dtype)
            return y if bias is None else y + bias
        return finish

    def shares_input_with(self, other) -> bool:
        if not isinstance(other, KernelLinear):
            return False
        same_perm = other.perm is self.perm or (self.perm is not None and other.perm is not None
                                                 and torch.equal(self.perm, other.perm))
        return other.lin is self.lin and other.k_op == self.k_op and other.k == self.k \
            and other.group_size == self.group_size and same_perm


def run_together(linears: list[KernelLinear], x: torch.Tensor) -> list[torch.Tensor]:
    """Several Linears on one input (shares_input_with each other) in one submission: x is quantized once and
    their work shares one queue (gate + up of a SwiGLU MLP)."""
    first = linears[0]
    x2 = first._input(x)
    outs = [torch.empty((x2.shape[0], li.n), dtype=torch.float32) for li in linears]
    if x2.shape[0]:
        first.lin.submit_prepared(tuple(li.id for li in linears), x2, outs)
        first.lin.sync()
    return [o.reshape(*x.shape[:-1], li.n) if x.dtype == torch.float32 else o.reshape(*x.shape[:-1], li.n).to(x.dtype)
            for o, li in zip(outs, linears)]


class AbsorbedKvB:
    """MLA's kv_b_proj W (nh*(dn+dv), R) in the absorbed form, on the Linear op (no float copy):
      q_lat[t, h] = W_uk[h]^T q_nope[t, h]   (R,)   W_uk[h]: rows h*(dn+dv) .. +dn of W, contracted over its rows
      o[t, h]     = W_uv[h] lat_out[t, h]    (dv,)  W_uv[h]: rows h*(dn+dv)+dn .. +dv, contracted over R
    W_uv runs on kv_b's registered tiles: one grouped submit, one row group per head. W_uk is contracted along W's
    output rows, across its scale groups (which run along R). With W[d, r] = (c[d, r] - Z) s[d, r // G],
      q_lat[r] = sum_d (c[d, r] - Z) * (s[d, r // G] q[d]),
    so its codes are transposed once (at first use) into an (nh*R, dn) Linear with scale 1 per row, and each of a
    head's R / G scale groups gets its own input q * s[:, g]: one grouped submit over nh*R/G row groups. Nothing is
    re-quantized: codes are moved, the scales move to the input side (int8 activations, as every Linear has).
    Bytes per token: W_uk's codes (bits/8 per weight) + W_uv's tiles, i.e. about kv_b's own size."""

    def __init__(self, kv_b: KernelLinear, nh: int, dn: int, dv: int, R: int):
        if not self.supported(kv_b, nh, dn, dv, R):
            raise LayoutError(f"{kv_b.name}: absorbed form needs (nh*(dn+dv), R) with dn, dv multiples of 16")
        self.kv_b, self.nh, self.dn, self.dv, self.R = kv_b, nh, dn, dv, R
        g = kv_b.geom
        self.G = R if g.group_size == GROUP_PER_ROW else g.group                 # scale group along R
        ng = R // self.G
        codes, scales = unpack_linear_codes(kv_b.qweight, kv_b.scales, g)       # (N, R) u8, (N, ng) f32
        c_uk = codes.reshape(nh, dn + dv, R)[:, :dn]                             # (nh, dn, R)
        codes_kn = np.ascontiguousarray(c_uk.transpose(1, 0, 2)).reshape(dn, nh * R)   # (K=dn, N=nh*R)
        lin = kv_b.lin
        self.uk_id = lin.n_linears
        self.uk_q, self.uk_s = lin.repack(codes_kn, np.ones((1, nh * R), np.float16), g.bits, GROUP_PER_ROW,
                                          scale_dtype=F16_SCALES.name)
        lin.add(self.uk_id, self.uk_q, self.uk_s, n=nh * R, k=dn, bits=g.bits, group_size=GROUP_PER_ROW)
        # s_uk[h*ng + g, d] = s[h*(dn+dv) + d, g]: the input scaling of head h's scale group g
        self.s_uk = torch.from_numpy(np.ascontiguousarray(
            scales.reshape(nh, dn + dv, ng)[:, :dn].transpose(0, 2, 1)).reshape(nh * ng, dn))   # float32

    @staticmethod
    def supported(kv_b, nh: int, dn: int, dv: int, R: int) -> bool:
        return (isinstance(kv_b, KernelLinear) and kv_b.n == nh * (dn + dv) and kv_b.k == kv_b.k_op == R
                and dn % 16 == 0 and dv % 16 == 0 and (kv_b.group_size == GROUP_PER_ROW or R % kv_b.group_size == 0)
                and kv_b.geom.k_pad == R)

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads: W_uk's transposed tiles and its input scales, W_uv's share of kv_b."""
        return (self.uk_q.nbytes + self.uk_s.nbytes + self.s_uk.numel() * 4
                + self.kv_b.nbytes * self.dv // (self.dn + self.dv))

    def q_latent(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope (m, nh, dn) float32/bfloat16, last dim contiguous (a view of q is fine) -> q_lat (m, nh, R)
        float32. Head h's ng = R/G row groups read q_nope[:, h] scaled by s_uk[h*ng + g] (inside the op)."""
        return self.q_latent_start(q_nope)()

    def q_latent_start(self, q_nope: torch.Tensor):
        """Submit q_latent(q_nope) and return a function that waits for the job and returns q_lat: torch work
        between the two calls overlaps the job (as KernelLinear.start)."""
        m, nh, R, G = q_nope.shape[0], self.nh, self.R, self.G
        out = torch.empty((m, nh * (R // G), G), dtype=torch.float32)                          # = (m, nh, R)
        if m:
            submit = self.kv_b.lin.submit_grouped_prepared if _heads_input(q_nope, nh, self.dn) else \
                self.kv_b.lin.submit_grouped          # (its checks name what is wrong)
            submit(self.uk_id, q_nope, out, 0, G, x_scale=self.s_uk)

        def finish() -> torch.Tensor:
            if m:
                self.kv_b.lin.sync()
            return out.view(m, nh, R)
        return finish

    def values(self, lat_out: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """lat_out (m, nh, R) float32/bfloat16, last dim contiguous -> o (m, nh, dv) float32 (into out if given: a
        contiguous float32 (m, nh, dv) tensor)."""
        m = lat_out.shape[0]
        if out is None:
            out = torch.empty((m, self.nh, self.dv), dtype=torch.float32)
        elif out.shape != (m, self.nh, self.dv) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"values: out {out.dtype} {tuple(out.shape)}, expected contiguous float32 "
                             f"({m}, {self.nh}, {self.dv})")
        if m:
            submit = self.kv_b.lin.submit_grouped_prepared if _heads_input(lat_out, self.nh, self.R) else \
                self.kv_b.lin.submit_grouped
            submit(self.kv_b.id, lat_out, out, self.dn, self.dn + self.dv)
            self.kv_b.lin.sync()
        return out


def _heads_input(x: torch.Tensor, nh: int, d: int) -> bool:
    """Whether x is what AbsorbedKvB's grouped submits take as they are: a CPU float32/bfloat16 (m, nh, d) tensor
    with a contiguous last dim (its outputs and scales are made by AbsorbedKvB itself)."""
    return (x.is_cpu and x.dim() == 3 and x.shape[1] == nh and x.shape[2] == d and x.stride(2) == 1
            and x.dtype in (torch.float32, torch.bfloat16))


def _supported(group_size: int) -> bool:
    return group_size == GROUP_PER_ROW or group_size == 32 or (group_size > 0 and group_size % 64 == 0)


def _marlin_codes(qweight: np.ndarray, k: int, n: int, bits: int) -> np.ndarray:
    """Marlin qweight (K/16, N*16*bits/32) int32 -> codes (K, N) uint8: ktlayouts.marlin.unpack_weight's result
    (tested equal through the tiles), ~20x faster: the words' bytes (and nibbles) in place of shifts, and a gather
    with the inverse permutation in place of a scatter. K, N: stored (padded) sizes."""
    b = np.ascontiguousarray(qweight).view(np.uint8)                    # little-endian: codes LSB first
    if bits == 4:
        t = np.empty((b.shape[0], b.shape[1] * 2), np.uint8)
        np.bitwise_and(b, 15, out=t[:, 0::2])
        np.right_shift(b, 4, out=t[:, 1::2])
    else:
        t = b
    inv = np.argsort(weight_perm(bits))
    t = np.take(t.reshape(-1, inv.size), inv, axis=1)                   # four row-major 16x16 tiles per row
    return t.reshape(k // 16, n // 16, 16, 16).transpose(0, 2, 1, 3).reshape(k, n)


def _gpu_codes(fmt, parts: dict, name: str):
    """-> (codes, packed, scales (n_groups, N_s), g_idx or None, stored geometry, logical (N, K)) of one Linear,
    without unpacking where the repack reads the stored words itself: gptq qweight (K*bits/32, N) and
    compressed-tensors weight_packed (N, K*bits/32) are words packed along K; Marlin is unpacked to (K, N) bytes."""
    parts = {p: np.asarray(a) for p, a in parts.items()}
    if fmt.family == "gptq":
        geom, shape = fmt.stored_geometry(parts, name)
        zeros = unpack_cols(parts["qzeros"], fmt.bits).astype(np.int32) + 1
        if np.any(zeros != zero_point(fmt.bits)):
            raise LayoutError(f"{name}: qzeros are not the symmetric v1 zero point {zero_point(fmt.bits) - 1}")
        return parts["qweight"], True, stored_scales(parts["scales"]), parts.get("g_idx"), geom, shape
    if fmt.family == "compressed-tensors":
        geom, shape = fmt.stored_geometry(parts, name)
        return parts["weight_packed"].T, True, stored_scales(parts["weight_scale"]).T, None, geom, shape
    if fmt.family == "marlin":
        geom, shape = fmt.stored_geometry(parts, name)
        return (_marlin_codes(parts["qweight"], geom.k, geom.n, fmt.bits), False,
                marlin_unpack_scales(parts["scales"], geom.k, geom.group_size), None, geom, shape)
    u = fmt.unpack(parts, name)
    return u.codes_kn, False, u.scales_gn, u.g_idx, u.geom, u.shape


def act_order_perm(g_idx: np.ndarray, group_size: int) -> np.ndarray | None:
    """The input-channel order that makes an act-order g_idx's groups consecutive (stable argsort), or None when
    that does not give k // G (groups of other sizes than G)."""
    g_idx = np.asarray(g_idx)
    if group_size == GROUP_PER_ROW or g_idx.size % group_size:
        return None
    perm = np.argsort(g_idx, kind="stable")
    return perm if np.array_equal(g_idx[perm], np.arange(g_idx.size) // group_size) else None


def repack_linear(lin: LinearKernels, linear_id: int, name: str, layout: str, parts: dict, dtype: torch.dtype
                  ) -> KernelLinear | None:
    """One GPU Linear (its parts {suffix: array}) -> a registered KernelLinear; None when the op cannot hold it
    exactly (a g_idx whose groups are not G channels each, unsupported group size): the caller dequantizes it."""
    fmt = gpu_format(layout)
    codes, packed, scales, g_idx, stored, (n, k) = _gpu_codes(fmt, parts, name)
    g = stored.group_size
    if not _supported(g):
        return None
    perm = None
    if g_idx is not None and not np.array_equal(g_idx, stored.default_g_idx()):
        perm = act_order_perm(g_idx, g)
        if perm is None or k != stored.k:
            return None
        codes = unpack_rows(codes, fmt.bits) if packed else np.asarray(codes)   # (K, N) bytes, rows permutable
        codes, packed = np.ascontiguousarray(codes[perm]), False
    k_op = k if g == GROUP_PER_ROW else _round_up(k, g)          # <= stored K: the extra codes are zero points
    n_groups = 1 if g == GROUP_PER_ROW else k_op // g
    if packed and k_op != stored.k:    # words cannot be cropped along K (gptq / compressed-tensors never pad)
        raise LayoutError(f"{name}: logical K={k} in a {stored.k}-deep {fmt.name} Linear")
    codes = codes[:, :n] if packed else codes[:k_op, :n]
    scales = scales[:n_groups, :n]
    if scales.dtype == np.float16:   # the GPU's float16 scales moved as they are (half the bytes of float32)
        geom = linear_geometry(n, k_op, fmt.bits, g, F16_SCALES.name)
        qw, sc = lin.repack(codes, scales, fmt.bits, g, packed=packed, scale_dtype=F16_SCALES.name)
    else:   # float32 scales (stored so by some sources): codes through the repack, scales placed here
        geom = linear_geometry(n, k_op, fmt.bits, g)
        qw, sc = lin.repack(codes, np.ones((n_groups, n), np.float16), fmt.bits, g, packed=packed)
        s = np.zeros((geom.scales_shape[0] * 16, geom.scales_shape[1]), np.float32)   # (N_pad, n_groups)
        s[:n, :n_groups] = scales.T.astype(np.float32)
        sc[...] = s.reshape(geom.scales_shape[0], 16, geom.scales_shape[1]).transpose(0, 2, 1)
    lin.add(linear_id, qw, sc, n=n, k=k_op, bits=fmt.bits, group_size=g)
    return KernelLinear(name, lin, linear_id, n, k, k_op, geom, qw, sc, dtype,
                        None if perm is None else torch.from_numpy(perm.astype(np.int64)))


def place_on_kernels(quantized: dict[str, dict], lin: LinearKernels, dtype: torch.dtype
                     ) -> tuple[dict[str, KernelLinear], dict[str, dict], dict]:
    """quantized: {file: {name: (array, manifest entry)}} -> ({hub weight name: KernelLinear}, the tensors left to
    dequantize {file: {name: ...}}, stats {linears, bytes, seconds, left})."""
    t0 = time.perf_counter()
    out: dict[str, KernelLinear] = {}
    rest: dict[str, dict] = {}
    for where, group in quantized.items():
        arrays = {n: a for n, (a, _t) in group.items()}
        layouts = {n: t["layout"] for n, (_a, t) in group.items()}
        done: set[str] = set()
        for weight, layout in quantized_linears(arrays, layouts).items():
            parts = linear_parts(layout, arrays, weight)
            try:
                kl = repack_linear(lin, lin.n_linears, weight, layout, parts, dtype)
            except LayoutError as e:
                raise LayoutError(f"{where}: {e}") from None
            if kl is not None:
                out[weight] = kl
                base = weight.removesuffix("weight")
                done |= {n for n in group if n.startswith(base) and n[len(base):] in parts}
        left = {n: v for n, v in group.items() if n not in done}
        if left:
            rest[where] = left
    stats = {"linears": len(out), "bytes": sum(v.nbytes for v in out.values()),
             "seconds": time.perf_counter() - t0, "left": sum(len(v) for v in rest.values())}
    return out, rest, stats
