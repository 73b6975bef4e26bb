"""ktrun.ops.linear: dense quantized Linears y = x W^T on the CPU, computed by libktkernels on the cpu-linear-int4/int8
tiles (layouts/README.md "CPU dense Linears": one cpu-expert matrix per Linear) in place, on the same persistent
thread pool as the routed experts (a ktrun.ops.moe.MoEKernels context).

Usage::

    from ktrun.ops.linear import LinearKernels
    lin = LinearKernels(moe)                 # moe: a MoEKernels (its pool and backend); or LinearKernels(n_threads=2)
    lin.add(0, qweight, scales, n=1536, k=7168, bits=4, group_size=128)    # arrays kept referenced, never copied
    lin.add_gpu(1, codes_kn, scales_gn, bits=4, group_size=128)            # GPU codes: repacked once (C++)
    y = lin.forward(0, x)                    # x (T, K) float32/bfloat16 -> y (T, N) float32
    lin.submit(0, x, out); ...; lin.sync()   # async: returns at once, torch work overlaps until sync()
    q, kv = lin.forward([0, 1], x)           # Linears sharing one input (same K and G) in one submission

- qweight (N_pad/16, K_pad/64, tile_bytes) uint8 and scales (N_pad/16, n_groups, 16) float32, as
  ktlayouts.cpu_linear.linear_geometry(n, k, bits, group_size) says (numpy arrays, memmaps of converted files, or
  CPU torch tensors; C-contiguous).
- x: numpy float32 / uint16 (bf16 bit patterns) or CPU torch float32 / bfloat16, rows contiguous (a row stride is
  fine). out: float32 (T, N), rows contiguous, e.g. a column slice of a wider buffer; overwritten.
- T = 1..8 tokens stream each weight once at the memory-bandwidth limit; more tokens use the compute-bound
  register-tiled loop (kernels/README.md "Dense Linears").
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from ktlayouts.cpu_expert import MatrixGeometry
from ktlayouts.cpu_linear import gpu_group_count, linear_geometry, linear_scale_dtypes
from ktlayouts.expert_formats import UNDECLARED_SCALE_DTYPE, scale_encoding

from .library import KernelError, _dtype_name, _err, _pointer, _shape, load_library
from .moe import MoEKernels

CODES_U8, CODES_PACKED_K = 0, 1   # ktkernels.h KT_CODES_U8 / KT_CODES_PACKED_K


def _numpy(a: Any, what: str) -> np.ndarray:
    """A numpy view of a numpy array or CPU torch tensor (no copy)."""
    if hasattr(a, "data_ptr"):
        if a.device.type != "cpu":
            raise ValueError(f"{what}: tensor is on {a.device}, the CPU kernels need CPU memory")
        a = a.detach().numpy()
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what}: expected a numpy array or torch tensor, got {type(a).__name__}")
    return a


def _strides(a: np.ndarray, what: str) -> tuple[int, int]:
    """Element strides of a 2-D array (non-negative, whole elements)."""
    if a.ndim != 2 or any(s < 0 or s % a.itemsize for s in a.strides):
        raise ValueError(f"{what}: expected a 2-D array with non-negative strides, got shape {a.shape} strides "
                         f"{a.strides}")
    return a.strides[0] // a.itemsize, a.strides[1] // a.itemsize


class LinearKernels:
    """Registered quantized Linears on a kernel context's pool. See the module docstring."""

    def __init__(self, kernels: MoEKernels | None = None, n_threads: int | None = None, numa_pools: int | None = None,
                 backend: str | None = None):
        self._owns = kernels is None
        self.kernels = MoEKernels(n_threads, numa_pools, backend) if kernels is None else kernels
        self._lib = load_library()
        self._linears: dict[int, tuple[MatrixGeometry, Any, Any]] = {}
        self._inflight: tuple | None = None
        self._calls: dict = {}   # ids -> (id list, geometries, ctypes ids)
        self._prepared: dict = {}   # ids tuple -> ctypes (ids, output pointers, output strides) of submit_prepared

    def close(self) -> None:
        if getattr(self, "_owns", False) and getattr(self, "kernels", None) is not None:
            self.kernels.close()
        self._inflight = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def backend(self) -> str:
        return self.kernels.backend

    @property
    def n_threads(self) -> int:
        return self.kernels.n_threads

    @property
    def n_linears(self) -> int:
        """How many Linears are registered (the next free id when ids are 0, 1, ...)."""
        return len(self._linears)

    def geometry(self, linear_id: int) -> MatrixGeometry:
        if linear_id not in self._linears:
            raise KeyError(f"linear {linear_id} was not added")
        return self._linears[linear_id][0]

    # --- registration ---------------------------------------------------------------------------

    def add(self, linear_id: int, qweight: Any, scales: Any, n: int, k: int, bits: int, group_size: int
            ) -> MatrixGeometry:
        """Register one Linear's packed tensors (kept referenced, read in place); scales float32 or float16."""
        sdt = _dtype_name(scales)
        encs = [scale_encoding(name) for name in linear_scale_dtypes()]
        enc = next((r for r in encs if sdt == r.array_dtype), None)       # float32, float16
        geom = linear_geometry(n, k, bits, group_size, UNDECLARED_SCALE_DTYPE if enc is None else enc.name)
        what = f"linear {linear_id}"
        if _shape(qweight) != geom.qweight_shape or _dtype_name(qweight) != "uint8":
            raise ValueError(f"{what} qweight: {_dtype_name(qweight)} {_shape(qweight)}, expected uint8 "
                             f"{geom.qweight_shape} for {geom}")
        if _shape(scales) != geom.scales_shape or enc is None:
            raise ValueError(f"{what} scales: {sdt} {_shape(scales)}, expected "
                             f"{' or '.join(r.array_dtype for r in encs)} {geom.scales_shape} for {geom}")
        q_ptr, s_ptr = _pointer(qweight, f"{what} qweight"), _pointer(scales, f"{what} scales")
        self.sync()
        if self._lib.kt_add_linear_ex(self.kernels.handle, linear_id, n, k, bits, group_size, enc.abi_code,
                                      q_ptr, s_ptr) != 0:
            raise KernelError(_err(self._lib))
        self._linears[linear_id] = (geom, qweight, scales)
        self._calls.clear()
        self._prepared.clear()
        return geom

    def repack(self, codes: Any, scales: Any, bits: int, group_size: int, packed: bool = False,
               out: tuple[np.ndarray, np.ndarray] | None = None, scale_dtype: str = UNDECLARED_SCALE_DTYPE
               ) -> tuple[np.ndarray, np.ndarray]:
        """GPU codes -> (qweight, scales) of cpu-linear-int{bits} (bit-exact; reference:
        ktlayouts.cpu_linear.repack_gpu_codes), on this context's threads.

        codes: (K, N) uint8 with zero point 2^(bits-1), any strides (a transposed (N, K) view works), or with
        packed=True the codes packed along K, 32/bits per int32 word LSB first: (K*bits/32, N) words (gptq qweight
        as stored; compressed-tensors weight_packed.T). scales: (n_groups, N) float16, any strides
        (compressed-tensors weight_scale.T). out: preallocated (qweight, scales) to write into (e.g. a mapped file).
        scale_dtype: the tiles' scales, "f32" (widened) or "f16" (the float16 bits moved: half the scale bytes a
        decode step reads, the same results).
        """
        if scale_dtype not in linear_scale_dtypes():
            raise ValueError(f"scale_dtype {scale_dtype!r}: expected {' or '.join(linear_scale_dtypes())}")
        enc = scale_encoding(scale_dtype)
        s_np = np.dtype(enc.array_dtype)
        c = _numpy(codes, "codes")
        s = _numpy(scales, "scales")
        if packed:
            if c.dtype not in (np.int32, np.uint32):
                raise ValueError(f"packed codes: dtype {c.dtype}, expected int32 words")
            k, n = c.shape[0] * 32 // bits if c.ndim == 2 else 0, c.shape[-1]
        else:
            if c.dtype != np.uint8:
                raise ValueError(f"codes: dtype {c.dtype}, expected uint8 (one code per byte)")
            k, n = c.shape if c.ndim == 2 else (0, 0)
        csk, csn = _strides(c, "codes")
        geom = linear_geometry(n, k, bits, group_size)
        if s.dtype != np.float16 or s.shape != (gpu_group_count(geom), n):
            raise ValueError(f"scales: {s.dtype} {s.shape}, expected float16 ({gpu_group_count(geom)}, {n})")
        ssg, ssn = _strides(s, "scales")
        if out is None:
            qw, sc = np.empty(geom.qweight_shape, np.uint8), np.empty(geom.scales_shape, s_np)
        else:
            qw, sc = out
            if _shape(qw) != geom.qweight_shape or _shape(sc) != geom.scales_shape:
                raise ValueError(f"out: shapes {_shape(qw)} / {_shape(sc)}, expected {geom.qweight_shape} / "
                                 f"{geom.scales_shape}")
        rc = self._lib.kt_linear_repack_ex(self.kernels.handle, n, k, bits, group_size, c.ctypes.data,
                                           CODES_PACKED_K if packed else CODES_U8, csk, csn, s.ctypes.data, ssg, ssn,
                                           _pointer(qw, "out qweight", np.dtype(np.uint8)),
                                           _pointer(sc, "out scales", np.dtype(s_np)),
                                           enc.abi_code)
        if rc != 0:
            raise KernelError(_err(self._lib))
        return qw, sc

    def add_gpu(self, linear_id: int, codes: Any, scales: Any, bits: int, group_size: int, packed: bool = False
                ) -> MatrixGeometry:
        """repack() then add(): the repacked tiles are owned (and kept) here."""
        qw, sc = self.repack(codes, scales, bits, group_size, packed=packed)
        c = _numpy(codes, "codes")
        k = c.shape[0] * 32 // bits if packed else c.shape[0]
        return self.add(linear_id, qw, sc, n=c.shape[1], k=k, bits=bits, group_size=group_size)

    # --- running --------------------------------------------------------------------------------

    def submit(self, ids: int | Sequence[int], x: Any, out: Any = None):
        """Start y = x W^T for one Linear id, or several sharing x (one list of outputs then), and return the
        output(s) at once (allocated if out is None). Call sync() before reading them."""
        single = isinstance(ids, (int, np.integer))
        key = int(ids) if single else tuple(int(i) for i in ids)
        call = self._calls.get(key)
        if call is None:   # per id tuple, once: geometries and the ctypes id array (a decode step repeats them)
            id_list = [key] if single else list(key)
            if not id_list:
                raise ValueError("no linear ids")
            geoms = [self.geometry(i) for i in id_list]
            call = self._calls[key] = (id_list, geoms, (ctypes.c_int32 * len(id_list))(*id_list))
        id_list, geoms, ids_c = call
        x_dtype, x_ptr, x_stride, T = MoEKernels._activation(x, geoms[0].k)
        outs = [out] if single else (list(out) if out is not None else [None] * len(id_list))
        if len(outs) != len(id_list):
            raise ValueError(f"{len(id_list)} linears but {len(outs)} outputs")
        ptrs, strides = (ctypes.c_void_p * len(outs))(), (ctypes.c_int64 * len(outs))()
        for i, (g, o) in enumerate(zip(geoms, outs)):
            if o is None:
                o = outs[i] = np.empty((T, g.n), np.float32)
            ptrs[i], strides[i] = self._output(o, T, g.n, id_list[i])
        rc = self._lib.kt_linear_submit(self.kernels.handle, len(id_list), ids_c, T, x_ptr, x_dtype, x_stride,
                                        ptrs, strides)
        if rc != 0:
            raise KernelError(_err(self._lib))
        self._inflight = (x, outs)   # alive until sync (the C side has waited for any earlier job)
        return outs[0] if single else outs

    def submit_prepared(self, ids: tuple[int, ...], x: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """submit() without the Python checks, for a caller that made its arguments itself (ktrun.ops.kernel_linear):
        x a CPU float32/bfloat16 (T, K) tensor with contiguous rows, outs contiguous float32 (T, N_i) CPU tensors.
        The C side still checks ids, K, strides and pointers. A decode step submits ~20 jobs, and submit()'s checks
        and ctypes arrays took ~3x the C call (50-90 us per job in a decode step, caches cold after the job)."""
        c = self._prepared.get(ids)
        if c is None:
            for i in ids:
                self.geometry(i)   # KeyError for an unknown id
            n = len(ids)
            c = self._prepared[ids] = ((ctypes.c_int32 * n)(*ids), (ctypes.c_void_p * n)(), (ctypes.c_int64 * n)())
        ids_c, ptrs, strides = c   # the C side copies them: reused by the next submit of these ids
        for i, o in enumerate(outs):
            ptrs[i], strides[i] = o.data_ptr(), o.shape[1]
        T, k = x.shape
        rc = self._lib.kt_linear_submit(self.kernels.handle, len(ids), ids_c, T, x.data_ptr(),
                                        0 if x.dtype == torch.float32 else 1, x.stride(0) if T > 1 else k, ptrs,
                                        strides)
        if rc != 0:
            raise KernelError(_err(self._lib))
        self._inflight = (x, outs)

    def submit_grouped(self, linear_id: int, x: Any, out: Any, row0: int, row_step: int,
                       x_scale: torch.Tensor | None = None) -> None:
        """Start out[:, j] = x_j W[row0 + j*row_step : + rows]^T for every group j (per-head products of one
        Linear, each head with its own input: MLA's absorbed kv_b). out: (T, J, rows) float32 CPU tensor (rows a
        multiple of 16); x: (T, Jx, K) float32/bfloat16 CPU tensor with J a multiple of Jx: groups j*Jx/J .. share
        input x[:, j // (J/Jx)]; x_scale: (J, K) float32, contiguous: group j's input is multiplied by x_scale[j]
        (float32) before the int8 quantization. Any strides with contiguous last dims. Call sync() before reading
        out."""
        geom = self.geometry(linear_id)
        if x.dim() != 3 or x.shape[2] != geom.k or x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"linear {linear_id} grouped x: {x.dtype} {tuple(x.shape)}, expected float32/bfloat16 "
                             f"(T, J, {geom.k})")
        T, J, rows = x.shape[0], out.shape[1] if out.dim() == 3 else -1, out.shape[-1] if out.dim() == 3 else -1
        if out.dim() != 3 or out.shape[0] != T or out.dtype != torch.float32 or x.shape[1] < 1 or J % x.shape[1]:
            raise ValueError(f"linear {linear_id} grouped out: {out.dtype} {tuple(out.shape)}, expected float32 "
                             f"({T}, J, rows) with J a multiple of x's {x.shape[1]} groups")
        if (x.numel() and x.stride(2) != 1) or (out.numel() and out.stride(2) != 1):
            raise ValueError(f"linear {linear_id} grouped: the last dim of x and out must be contiguous")
        if x.device.type != "cpu" or out.device.type != "cpu":
            raise ValueError(f"linear {linear_id} grouped: x and out must be CPU tensors")
        if x_scale is not None and (tuple(x_scale.shape) != (J, geom.k) or x_scale.dtype != torch.float32
                                    or not x_scale.is_contiguous() or x_scale.device.type != "cpu"):
            raise ValueError(f"linear {linear_id} grouped x_scale: {x_scale.dtype} {tuple(x_scale.shape)}, expected "
                             f"contiguous float32 ({J}, {geom.k})")
        rc = self._lib.kt_linear_submit_grouped_scaled(
            self.kernels.handle, linear_id, J, row0, row_step, rows, T, x.data_ptr(),
            0 if x.dtype == torch.float32 else 1, x.stride(0), x.stride(1), J // x.shape[1],
            None if x_scale is None else x_scale.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1))
        if rc != 0:
            raise KernelError(_err(self._lib))
        self._inflight = (x, out, x_scale)

    def submit_grouped_prepared(self, linear_id: int, x: torch.Tensor, out: torch.Tensor, row0: int, row_step: int,
                                x_scale: torch.Tensor | None = None) -> None:
        """submit_grouped() without the Python checks, for a caller that made its tensors itself (ktrun.ops.kernel_linear's
        AbsorbedKvB, twice per MLA layer in a decode step): the same arguments, already as submit_grouped requires
        them. The C side still checks the id, the groups and the rows."""
        J = out.shape[1]
        rc = self._lib.kt_linear_submit_grouped_scaled(
            self.kernels.handle, linear_id, J, row0, row_step, out.shape[2], x.shape[0], x.data_ptr(),
            0 if x.element_size() == 4 else 1, x.stride(0), x.stride(1), J // x.shape[1],
            None if x_scale is None else x_scale.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1))
        if rc != 0:
            raise KernelError(_err(self._lib))
        self._inflight = (x, out, x_scale)

    @staticmethod
    def _output(o: Any, T: int, n: int, linear_id: int) -> tuple[int, int]:
        """-> (pointer, row stride in elements) of a (T, N) float32 output with contiguous rows."""
        if isinstance(o, np.ndarray):
            ok = o.dtype == np.float32 and o.shape == (T, n)
            row, col = (o.strides[0] // 4, o.strides[1] // 4) if ok else (0, 0)
            ptr = o.ctypes.data
        else:
            ok = _dtype_name(o) == "float32" and _shape(o) == (T, n)
            row, col = (o.stride(0), o.stride(1)) if ok else (0, 0)
            ptr = _pointer(o, f"out of linear {linear_id}", contiguous=False)
        if not ok:
            raise ValueError(f"out of linear {linear_id}: {_dtype_name(o)} {_shape(o)}, expected float32 ({T}, {n})")
        if T and n > 1 and col != 1:
            raise ValueError(f"out of linear {linear_id}: rows must be contiguous")
        return ptr, (row if T > 1 else n)

    def sync(self) -> None:
        if self._inflight is None:
            return
        rc = self._lib.kt_sync(self.kernels.handle)
        self._inflight = None
        if rc != 0:
            raise KernelError(_err(self._lib))

    def forward(self, ids: int | Sequence[int], x: Any, out: Any = None):
        out = self.submit(ids, x, out)
        self.sync()
        return out
