"""ktrun.ops.moe: the routed-expert part of MoE layers on the CPU, computed by libktkernels on the packed
cpu-expert layouts (layouts/README.md) in place: the weight arrays are read where they lie (numpy memmaps of the
converted safetensors files), never copied.

For T tokens with k routed experts each:  out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])).

Usage (the decode loop)::

    from ktrun.ops.moe import ExpertShard, MoEKernels
    moe = MoEKernels()                       # all CPUs, one sub-pool per NUMA node, best backend of this CPU
    moe.add_layer(3, shards=[ExpertShard(gate_q, gate_s, up_q, up_s, down_q, down_s, i0, i1), ...],
                  n_experts=256, hidden=7168, intermediate_pad=2048, bits=4, group_size=128)
    moe.submit(3, x, ids, weights, out)      # returns at once; x (T, H) f32/bf16, ids (T, k) int, weights (T, k)
    ...                                      # GPU work (attention, shared expert) runs meanwhile
    moe.sync()                               # out (T, H) f32 now holds the routed-expert sum
    y = moe.forward(3, x, ids, weights)      # submit + sync, returns a new (T, H) float32 array

- Shard arrays stack all experts of one layer: gate_q (E, (i1-i0)/16, K_pad/64, tile_bytes) uint8,
  gate_s (E, (i1-i0)/16, n_groups, 16) float32 (layout version 1) or float16 / bfloat16 (version 2; numpy holds bfloat16
  as uint16 bit patterns: pass scale_dtype="bfloat16") or uint8 two-level records (version 3, int4 group 32:
  scale_dtype="sub6"), up likewise, down_q (E, round_up(H,16)/16, (i1-i0)/64, tile_bytes),
  down_s; bf16 layout (bits=16): scales are None. [i0, i1) are the shard's rows of the padded intermediate size
  (`ktlayouts.expert_shards.ShardPlan.shard_range`, checked). Shards are mapped to the sub-pools with
  `ktlayouts.converted_dir.node_unit_ranges` (M < S: a pool takes whole shards; M > S: pools split a shard's units).
- x, ids, weights and out may be numpy arrays or CPU torch tensors (passed by pointer; this object keeps them alive
  until sync). x: float32 or bfloat16 (torch) / uint16 bf16 bit patterns (numpy). ids < 0 are skipped.
  `accumulate=True` adds into out instead of overwriting it. `skip=` (n_experts,) uint8: experts marked nonzero
  are computed elsewhere (GPU-resident) and left out here exactly as ids < 0 would be; the mask is read during
  submit() only (the ids are not copied or rewritten), so it may change between submits.
- Backend: `backend=` or env KT_KERNEL_BACKEND = scalar | avx2 | avx512 | amx (error if this CPU lacks it);
  default the best one. Threads: `n_threads=` (default all CPUs of the process), `numa_pools=` (default env
  KT_NUMA_POOLS, else one per NUMA node; more pools than nodes splits the CPUs, to simulate NUMA).
- Library: loaded once by ktrun.ops.library (its path, ABI check and the whole C signature table).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
from ktlayouts.converted_dir import node_unit_ranges
from ktlayouts.cpu_expert import MatrixGeometry
from ktlayouts.expert_formats import (
    UNDECLARED_SCALE_DTYPE,
    LayoutError,
    expert_format_of_bits,
    scale_encoding_of_array,
    scale_encodings,
)
from ktlayouts.expert_shards import ShardPlan

from .library import (
    ACTIVATION_CODES,
    BACKENDS,
    SCALE_DTYPE_CODES,
    KernelError,
    _dtype_name,
    _err,
    _Piece,
    _pointer,
    _shape,
    load_library,
    stream_probe_bytes,
)


@dataclass(frozen=True)
class ExpertShard:
    """One NUMA shard of a layer's routed experts (arrays stack all experts; see the module docstring)."""
    gate_q: Any
    gate_s: Any
    up_q: Any
    up_s: Any
    down_q: Any
    down_s: Any
    i0: int
    i1: int


def _scale_dtype(a: Any, declared: str | None) -> str:
    """float32 / float16 / bfloat16 / sub6 of a scales array (numpy uint16 = bfloat16 bit patterns, uint8 = two-level
    records)."""
    name = _dtype_name(a)
    try:
        name = scale_encoding_of_array(name).runtime_name
    except LayoutError:
        pass
    if name not in SCALE_DTYPE_CODES or (declared is not None and declared != name):
        kinds = [r.runtime_name if r.elementwise else f"{r.what} ({r.name}, {r.array_dtype} records)"
                 for r in scale_encodings()]
        raise ValueError(f"scales dtype {name}{'' if declared is None else f' (declared {declared})'}: expected "
                         f"{', '.join(kinds[:-1])} or {kinds[-1]}")
    return name


def _layout_scale_dtype(shards: list, declared: str | None) -> str:
    """The ktlayouts scale dtype (f32 / f16 / bf16 / sub6) of a layer's first scales array: its geometry (two-level
    scales pad K to 256) is needed before the arrays are checked; add_layer checks that all agree."""
    a = next((x for sh in shards for x in (sh.gate_s, sh.up_s, sh.down_s) if x is not None), None)
    if a is None:
        return UNDECLARED_SCALE_DTYPE
    try:
        return scale_encoding_of_array(_scale_dtype(a, declared)).name
    except ValueError:
        return UNDECLARED_SCALE_DTYPE          # reported with the layer's name below


def _check_matrix(q: Any, s: Any, geom: MatrixGeometry, n_experts: int, what: str) -> None:
    want_q = (n_experts, *geom.qweight_shape)
    if _shape(q) != want_q or _dtype_name(q) != "uint8":
        raise ValueError(f"{what}.qweight: shape {_shape(q)}, expected uint8 {want_q}")
    if not geom.format.quantized:
        if s is not None:
            raise ValueError(f"{what}.scales: the bf16 layout has no scales")
        return
    want_s = (n_experts, *geom.scales_shape)
    if s is None or _shape(s) != want_s:
        raise ValueError(f"{what}.scales: shape {None if s is None else _shape(s)}, expected {want_s}")


class MoEKernels:
    """Persistent kernel context: thread pool + registered layers. See the module docstring."""

    def __init__(self, n_threads: int | None = None, numa_pools: int | None = None, backend: str | None = None):
        self._lib = load_library()
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
        ctx = self._lib.kt_create(n_threads or 0, numa_pools or 0, backend.encode() if backend else None)
        if not ctx:
            raise KernelError(_err(self._lib))
        self._ctx = ctx
        self._layers: dict[int, tuple[dict, list]] = {}
        self._inflight: tuple | None = None

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._lib.kt_destroy(self._ctx)
            self._ctx = None
            self._inflight = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def handle(self) -> int:
        """The kt_ctx pointer (for ktrun.ops.linear, which runs on this context's pool)."""
        if not getattr(self, "_ctx", None):
            raise KernelError("the kernel context is closed")
        return self._ctx

    @property
    def backend(self) -> str:
        return self._lib.kt_backend_name(self._ctx).decode()

    @property
    def backend_detail(self) -> str:
        return self._lib.kt_backend_detail(self._ctx).decode()

    @property
    def n_threads(self) -> int:
        return self._lib.kt_n_threads(self._ctx)

    @property
    def numa_pools(self) -> int:
        return self._lib.kt_n_pools(self._ctx)

    def wake(self) -> None:
        """Wake the pool's workers, asleep after an idle stretch, ahead of a burst of jobs (kt_pool_wake: an empty
        job, not waited for; the next submit waits for it). A decode step calls it before its Python work, so the
        step's first job does not wait for the futex wake-up and the scheduler."""
        self._lib.kt_pool_wake(self.handle)

    def rest(self) -> None:
        """The opposite, after a burst of jobs: idle workers sleep at once instead of spinning up to 1 ms for the next
        job (kt_pool_rest). A server calls it after each step: its event loop and its clients need the cores while
        it writes the step's tokens; the next step's wake() or first job wakes them."""
        self._lib.kt_pool_rest(self.handle)

    def thread_cpus(self) -> list[tuple[int, int]]:
        """(sub-pool, pinned CPU or -1) per worker. Worker 0 is the thread calling sync() (it computes its share
        of the job there; not pinned: -1) unless KT_POOL_CALLER=0 made it a pinned thread too."""
        return [(self._lib.kt_thread_pool(self._ctx, i), self._lib.kt_thread_cpu(self._ctx, i))
                for i in range(self.n_threads)]

    def add_layer(self, layer_id: int, shards: list[ExpertShard], n_experts: int, hidden: int, intermediate_pad: int,
                  bits: int, group_size: int, scale_dtype: str | None = None) -> None:
        """Register one layer's experts (arrays are kept referenced, never copied). scale_dtype: float32, float16,
        bfloat16 or sub6 (default: from the scales arrays' dtype, numpy uint16 meaning bfloat16, uint8 two-level)."""
        if not shards:
            raise ValueError(f"layer {layer_id}: no shards")
        sd = _layout_scale_dtype(shards, scale_dtype) if expert_format_of_bits(bits).quantized \
            else UNDECLARED_SCALE_DTYPE
        # shard -> sub-pool pieces: ktlayouts' integer unit ranges (M < S: whole shards, M > S: split units)
        plan = ShardPlan(intermediate=intermediate_pad, group_size=group_size, n_shards=len(shards), bits=bits,
                         scale_dtype=sd)
        got = [(sh.i0, sh.i1) for sh in shards]
        if got != plan.shard_ranges():
            raise ValueError(f"layer {layer_id}: shard ranges {got} are not the {len(shards)}-shard split of "
                             f"intermediate_pad {intermediate_pad}: {plan.shard_ranges()}")
        pieces = []
        for node, parts in enumerate(node_unit_ranges(plan, self.numa_pools)):
            for s_idx, u0, u1 in parts:
                sh = shards[s_idx]
                width = sh.i1 - sh.i0
                gu = MatrixGeometry(n=width, k=hidden, bits=bits, group_size=group_size, scale_dtype=sd)
                dn = MatrixGeometry(n=hidden, k=width, bits=bits, group_size=group_size, scale_dtype=sd)
                what = f"layer {layer_id} shard {s_idx} [{sh.i0}, {sh.i1})"
                _check_matrix(sh.gate_q, sh.gate_s, gu, n_experts, what + " gate")
                _check_matrix(sh.up_q, sh.up_s, gu, n_experts, what + " up")
                _check_matrix(sh.down_q, sh.down_s, dn, n_experts, what + " down")
                ptrs = [None if a is None else _pointer(a, f"{what} {name}") for a, name in (
                    (sh.gate_q, "gate.qweight"), (sh.gate_s, "gate.scales"), (sh.up_q, "up.qweight"),
                    (sh.up_s, "up.scales"), (sh.down_q, "down.qweight"), (sh.down_s, "down.scales"))]
                pieces.append(_Piece(*ptrs, sh.i0, sh.i1, u0 * plan.unit, u1 * plan.unit, node))
        dtypes = set()
        for sh in shards:
            for a in (sh.gate_s, sh.up_s, sh.down_s):
                if a is not None:
                    try:
                        dtypes.add(_scale_dtype(a, scale_dtype))
                    except ValueError as e:
                        raise ValueError(f"layer {layer_id}: {e}") from None
        if len(dtypes) > 1:
            raise ValueError(f"layer {layer_id}: scales of one layer must share a dtype, got {sorted(dtypes)}")
        code = SCALE_DTYPE_CODES[dtypes.pop()] if dtypes else 0
        arr = (_Piece * len(pieces))(*pieces)
        if self._lib.kt_add_layer_ex(self._ctx, layer_id, n_experts, hidden, intermediate_pad, bits, group_size, code,
                                     len(pieces), arr) != 0:
            raise KernelError(_err(self._lib))
        self._layers[layer_id] = ({"hidden": hidden, "n_experts": n_experts, "intermediate_pad": intermediate_pad},
                                  list(shards))

    def set_activation(self, layer_id: int, kind: str, alpha: float = 1.702, limit: float = 7.0,
                       gate_bias: np.ndarray | None = None, up_bias: np.ndarray | None = None,
                       down_bias: np.ndarray | None = None) -> None:
        """The layer's expert activation (ACTIVATION_CODES; "swiglu_clamped": gpt-oss) and biases: gate_bias /
        up_bias (E, intermediate_pad), down_bias (E, hidden) float32, kept referenced (read in place)."""
        if layer_id not in self._layers:
            raise KeyError(f"layer {layer_id} was not added")
        if kind not in ACTIVATION_CODES:
            raise ValueError(f"layer {layer_id}: activation {kind!r} is not one of {', '.join(ACTIVATION_CODES)}")
        meta = self._layers[layer_id][0]
        E, H, ipad = meta["n_experts"], meta["hidden"], meta["intermediate_pad"]
        arrays = []
        for a, shape, name in ((gate_bias, (E, ipad), "gate_bias"), (up_bias, (E, ipad), "up_bias"),
                               (down_bias, (E, H), "down_bias")):
            if a is None:
                arrays.append(None)
                continue
            a = np.ascontiguousarray(a, dtype=np.float32)
            if a.shape != shape:
                raise ValueError(f"layer {layer_id}: {name} has shape {a.shape}, expected {shape}")
            arrays.append(a)
        self.sync()
        if self._lib.kt_set_layer_activation(self._ctx, layer_id, ACTIVATION_CODES[kind], float(alpha), float(limit),
                                             *[None if a is None else a.ctypes.data for a in arrays]) != 0:
            raise KernelError(_err(self._lib))
        meta["activation"] = arrays           # alive while the layer is registered

    def submit(self, layer_id: int, x: Any, ids: Any, weights: Any, out: Any = None, accumulate: bool = False,
               skip: np.ndarray | None = None, shared: int | None = None, shared_weights: Any = None):
        """Start the layer on the pool and return at once (out, allocated if None). Call sync() before using out.
        skip: (n_experts,) uint8 mask of experts to leave out (computed elsewhere), or None.
        shared: a layer id added with one expert (a shared expert's gate/up/down): computed in the same job and added
        to out after the routed experts, times shared_weights (T,) float32 (None: 1)."""
        if layer_id not in self._layers:
            raise KeyError(f"layer {layer_id} was not added")
        sw = None
        if shared is not None:
            if shared not in self._layers or self._layers[shared][0]["n_experts"] != 1:
                raise KeyError(f"shared expert layer {shared} was not added with one expert")
            if shared_weights is not None:
                sw = np.ascontiguousarray(shared_weights.detach().cpu().float().numpy()
                                          if hasattr(shared_weights, "cpu") else shared_weights, dtype=np.float32)
        hidden, n_experts = self._layers[layer_id][0]["hidden"], self._layers[layer_id][0]["n_experts"]
        if skip is not None and (not isinstance(skip, np.ndarray) or skip.dtype != np.uint8
                                 or skip.shape != (n_experts,) or not skip.flags.c_contiguous):
            raise ValueError(f"skip: expected a contiguous uint8 numpy array of shape ({n_experts},), got "
                             f"{getattr(skip, 'dtype', type(skip).__name__)} {getattr(skip, 'shape', '')}")
        x_dtype, x_ptr, x_stride, T = self._activation(x, hidden)
        ids_np = np.ascontiguousarray(ids.cpu().numpy() if hasattr(ids, "cpu") else ids)
        w_np = np.ascontiguousarray(weights.detach().cpu().float().numpy() if hasattr(weights, "cpu") else weights,
                                    dtype=np.float32)
        if ids_np.ndim != 2 or ids_np.shape[0] != T or w_np.shape != ids_np.shape:
            raise ValueError(f"ids {ids_np.shape} and weights {w_np.shape} must both be (T={T}, k)")
        ids32 = ids_np.astype(np.int32, copy=False)
        if out is None:
            out = np.zeros((T, hidden), dtype=np.float32)
        if _shape(out) != (T, hidden):
            raise ValueError(f"out: shape {_shape(out)}, expected ({T}, {hidden})")
        if _dtype_name(out) != "float32":
            raise ValueError(f"out: dtype {out.dtype}, expected float32")
        out_ptr = _pointer(out, "out")
        self.sync()
        args = (self._ctx, layer_id, T, x_ptr, x_dtype, x_stride, ids32.shape[1], ids32.ctypes.data, w_np.ctypes.data,
                out_ptr, hidden, int(accumulate))
        if shared is not None:
            if sw is not None and sw.reshape(-1).shape != (T,):
                raise ValueError(f"shared_weights: shape {sw.shape}, expected ({T},)")
            rc = self._lib.kt_submit_shared(*args, None if skip is None else skip.ctypes.data, shared,
                                            None if sw is None else sw.ctypes.data)
        elif skip is None:
            rc = self._lib.kt_submit(*args)
        else:
            rc = self._lib.kt_submit_masked(*args, skip.ctypes.data)
        if rc != 0:
            raise KernelError(_err(self._lib))
        self._inflight = (x, ids32, w_np, out)   # alive until sync
        return out

    def submit_prepared(self, layer_id: int, x: Any, ids: Any, weights: Any, out: Any, shared: int | None = None,
                        shared_weights: Any = None) -> None:
        """submit() without the Python checks and conversions, for a caller that made its arguments itself
        (ktrun.experts.kernel, every decode step): x a CPU float32/bfloat16 (T, hidden) torch tensor with contiguous
        rows, ids a contiguous int32 (T, k) tensor, weights contiguous float32 (T, k), out a contiguous float32
        (T, hidden) tensor, shared_weights None or contiguous float32 (T,); shared a layer id registered with one
        expert. The C side still checks the layer ids; submit() took ~150 us of a decode step's MoE layer in its
        numpy conversions and checks, caches cold after the previous job."""
        T, hidden = x.shape
        args = (self._ctx, layer_id, T, x.data_ptr(), 0 if x.element_size() == 4 else 1,   # float32 / bfloat16
                x.stride(0) if T > 1 else hidden, ids.shape[1], ids.data_ptr(), weights.data_ptr(), out.data_ptr(),
                hidden, 0)
        self.sync()
        if shared is None:
            rc = self._lib.kt_submit(*args)
        else:
            rc = self._lib.kt_submit_shared(*args, None, shared,
                                            None if shared_weights is None else shared_weights.data_ptr())
        if rc != 0:
            raise KernelError(_err(self._lib))
        self._inflight = (x, ids, weights, out, shared_weights)   # alive until sync

    def hold(self, arrays: tuple) -> None:
        """Keep arrays alive until sync: a job submitted by another call on this context (glue.moe_decode's) reads
        or writes them."""
        self._inflight = arrays

    def sync(self) -> None:
        if self._inflight is None:
            return
        rc = self._lib.kt_sync(self._ctx)
        self._inflight = None
        if rc != 0:
            raise KernelError(_err(self._lib))

    def forward(self, layer_id: int, x: Any, ids: Any, weights: Any, out: Any = None, accumulate: bool = False,
                skip: np.ndarray | None = None, shared: int | None = None, shared_weights: Any = None):
        out = self.submit(layer_id, x, ids, weights, out, accumulate, skip, shared, shared_weights)
        self.sync()
        return out

    PROFILE_PHASES = ("x_quant", "wait_x", "gate_up", "wait_h", "down", "wait_pools", "reduce", "start_delay",
                      "cpu_time")

    def profile(self) -> list[dict[str, float]]:
        """Seconds each worker spent per phase of the last submit (see kt_profile in kernels/include/ktkernels.h)."""
        self.sync()
        n = len(self.PROFILE_PHASES)
        buf = (ctypes.c_double * (n * self.n_threads))()
        self._lib.kt_profile(self._ctx, buf, len(buf))
        return [dict(zip(self.PROFILE_PHASES, buf[n * i: n * (i + 1)])) for i in range(self.n_threads)]

    def measure_read_bandwidth(self, nbytes: int | None = None, reps: int = 5) -> float:
        """Memory read bandwidth with this pool's threads, bytes/s (best of reps), over nbytes (default
        stream_probe_bytes(): a buffer the last-level cache cannot hold)."""
        bw = self._lib.kt_measure_read_bandwidth(self._ctx, nbytes or stream_probe_bytes(), reps)
        if bw <= 0:
            raise KernelError(_err(self._lib))
        return bw

    def measure_int8_peak(self, seconds: float = 0.5) -> float:
        """Register-only int8 dot-product throughput (vpdpbusd) with this pool's threads, int8 ops/s."""
        return self._lib.kt_measure_int8_peak(self._ctx, seconds)

    def measure_tile_int8_peak(self, seconds: float = 0.5) -> float:
        """The AMX tile unit's int8 throughput (tdpbssd on tile registers) with this pool's threads, int8 ops/s; 0.0
        when this backend has no tiles."""
        return self._lib.kt_measure_tile_int8_peak(self._ctx, seconds)

    @staticmethod
    def _activation(x: Any, hidden: int) -> tuple[int, int, int, int]:
        """-> (dtype code, pointer, row stride in elements, T)."""
        shape = _shape(x)
        if len(shape) != 2 or shape[1] != hidden:
            raise ValueError(f"x: shape {shape}, expected (T, {hidden})")
        if hasattr(x, "data_ptr"):
            import torch
            if x.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"x: dtype {x.dtype}, expected float32 or bfloat16")
            if x.numel() and x.stride(1) != 1:
                raise ValueError("x: rows must be contiguous")
            stride = x.stride(0) if shape[0] > 1 else hidden
            return (0 if x.dtype == torch.float32 else 1), _pointer(x, "x", contiguous=False), stride, shape[0]
        if x.dtype not in (np.float32, np.uint16) or (x.size and x.strides[1] != x.itemsize):
            raise ValueError(f"x: dtype {x.dtype} with strides {x.strides}: expected float32 or uint16 (bf16 bits) rows")
        stride = x.strides[0] // x.itemsize if shape[0] > 1 else hidden
        return (0 if x.dtype == np.float32 else 1), x.ctypes.data, stride, shape[0]
