"""ktrun.ops.library: libktkernels, loaded once through ctypes, and everything every op shares: the whole C signature
table (one entry per exported function, checked against the library's ABI version), the ABI's codes (scale dtypes,
expert activations, backends), the error type, and the argument helpers (pointer, dtype and shape of a numpy array or
CPU torch tensor).

- Library: `libktkernels*.so` next to this module (built by `make kernels`), or the path in env KT_KERNELS_LIB.
- ABI codes: the scale dtype codes come from ktlayouts' expert format records (ktlayouts.expert_formats) and match
  kernels/src/scale_types.h (tests/test_kernel_abi_codes.py); the activation codes match KT_ACT_* in ktkernels.h.
"""
from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path
from typing import Any

import numpy as np
from ktlayouts.expert_formats import scale_encodings

ABI_VERSION = 26

# scale dtypes of the int layouts (layout version 1: float32; version 2: float16 / bfloat16; version 3: two-level
# records, uint8 arrays), by their runtime names -> the ABI's codes: the records' (ScaleEncoding.abi_code)
SCALE_DTYPE_CODES = {r.runtime_name: r.abi_code for r in scale_encodings()}
BACKENDS = ("scalar", "avx2", "avx512", "amx")
# expert activations (ktlayouts.families.ExpertActivation.kind) -> the ABI's codes (KT_ACT_*)
ACTIVATION_CODES = {"silu": 0, "swiglu_clamped": 1, "silu_clamped": 2}


class KernelError(RuntimeError):
    """An error reported by libktkernels (bad arguments, unsupported backend)."""


class _Piece(ctypes.Structure):
    _fields_ = [("gate_q", ctypes.c_void_p), ("gate_s", ctypes.c_void_p), ("up_q", ctypes.c_void_p),
                ("up_s", ctypes.c_void_p), ("down_q", ctypes.c_void_p), ("down_s", ctypes.c_void_p),
                ("i0", ctypes.c_int32), ("i1", ctypes.c_int32), ("r0", ctypes.c_int32), ("r1", ctypes.c_int32),
                ("pool", ctypes.c_int32)]


class GqaDecodeArgs(ctypes.Structure):
    """kt_gqa_decode_args (ktkernels.h), field for field."""
    _i64, _i32, _f, _p = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
    _fields_ = [("nh", _i64), ("nkv", _i64), ("hd", _i64), ("vd", _i64), ("T", _i64),
                ("q", _p), ("q_stride", _i64), ("k", _p), ("k_stride", _i64), ("v", _p), ("v_stride", _i64),
                ("norm", _i32), ("lanes", _i32), ("eps", _f), ("q_norm", _p), ("k_norm", _p),
                ("rope_half", _i64), ("interleaved", _i32), ("cos", _p), ("sin", _p), ("cs_stride", _i64),
                ("m", _i64), ("row0", _p), ("start", _p), ("table0", _p), ("tables", _p), ("block_size", _i64),
                ("k_cache", _p), ("k_block_stride", _i64), ("k_row_stride", _i64),
                ("v_cache", _p), ("v_block_stride", _i64), ("v_row_stride", _i64),
                ("scale", _f), ("window", _i64), ("out", _p), ("out_stride", _i64)]


class PromptAttendArgs(ctypes.Structure):
    """kt_prompt_attend_args (ktkernels.h), field for field."""
    _i64, _f, _p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    _fields_ = [("n", _i64), ("nh", _i64), ("nkv", _i64), ("dk", _i64), ("dk1", _i64), ("dv", _i64),
                ("start", _i64), ("window", _i64), ("q", _p), ("q_row", _i64), ("q_head", _i64),
                ("k", _p), ("k_row", _i64), ("k_head", _i64), ("k2", _p), ("k2_row", _i64), ("k2_head", _i64),
                ("v", _p), ("v_row", _i64), ("v_head", _i64), ("sinks", _p), ("scale", _f),
                ("out", _p), ("out_row", _i64), ("out_head", _i64)]


class GqaLayerArgs(ctypes.Structure):
    """kt_gqa_layer_args (ktkernels.h), field for field."""
    _i64, _i32, _p = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    _fields_ = [("attn", GqaDecodeArgs), ("x", _p), ("x_stride", _i64),
                ("q_id", _i32), ("k_id", _i32), ("v_id", _i32), ("o_id", _i32),
                ("q_bias", _p), ("k_bias", _p), ("v_bias", _p), ("o_bias", _p),
                ("out", _p), ("out_stride", _i64), ("n_out", _i64)]


class MlaDecodeArgs(ctypes.Structure):
    """kt_mla_decode_args (ktkernels.h), field for field."""
    _i64, _i32, _f, _p = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
    _fields_ = [("T", _i64), ("nh", _i64), ("dn", _i64), ("dr", _i64), ("dv", _i64), ("R", _i64), ("q_lora", _i64), ("q_b_k", _i64),
                ("x", _p), ("x_stride", _i64),
                ("q_a_id", _i32), ("kv_a_id", _i32), ("q_b_id", _i32), ("o_id", _i32), ("uk_id", _i32),
                ("kv_b_id", _i32), ("uk_group", _i64), ("uk_scale", _p),
                ("q_a_norm", _p), ("kv_a_norm", _p), ("eps", _f), ("lanes", _i32),
                ("cos", _p), ("sin", _p), ("cs_stride", _i64), ("interleaved", _i32),
                ("m", _i64), ("row0", _p), ("start", _p), ("table0", _p), ("tables", _p), ("block_size", _i64),
                ("cache", _p), ("block_stride", _i64), ("row_stride", _i64),
                ("scale", _f), ("out", _p), ("out_stride", _i64)]


class MoeDecodeArgs(ctypes.Structure):
    """kt_moe_decode_args (ktkernels.h), field for field."""
    _i64, _i32, _f, _p = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
    _fields_ = [("T", _i64), ("H", _i64), ("x", _p), ("x_stride", _i64), ("delta", _p), ("delta_stride", _i64),
                ("norm", _p), ("next_norm", _p), ("eps", _f), ("lanes", _i32),
                ("router", _i32), ("gate", _p), ("E", _i64), ("bias", _p), ("gate_dtype", _i32), ("n_group", _i64),
                ("topk_group", _i64),
                ("top_k", _i64), ("renorm", _i32), ("scaling", _f), ("layer", _i32), ("shared", _i32),
                ("finish", _i32), ("x_out", _p), ("h_out", _p), ("e_out", _p), ("ids", _p), ("weights", _p),
                ("wait_s", ctypes.c_double)]



class DecodeLayer(ctypes.Structure):
    """kt_decode_layer (ktkernels.h), field for field."""
    _fields_ = [("attn_ctx", ctypes.c_void_p), ("attn", ctypes.POINTER(GqaLayerArgs)),
                ("mla", ctypes.POINTER(MlaDecodeArgs)), ("moe_ctx", ctypes.c_void_p),
                ("moe", ctypes.POINTER(MoeDecodeArgs))]


class DecodeLayersArgs(ctypes.Structure):
    """kt_decode_layers_args (ktkernels.h), field for field."""
    _i64, _p = ctypes.c_int64, ctypes.c_void_p
    _fields_ = [("T", _i64), ("H", _i64), ("x", _p), ("h", _p), ("rows", ctypes.POINTER(GqaDecodeArgs)),
                ("n_layers", ctypes.c_int32), ("layers", ctypes.POINTER(DecodeLayer)), ("x_out", _p), ("h_out", _p),
                ("attn_s", ctypes.c_double), ("moe_s", ctypes.c_double), ("wait_s", ctypes.c_double),
                ("head_kind", ctypes.c_int32), ("head_id", ctypes.c_int32), ("head_ctx", _p), ("head_w", _p),
                ("head_w_dtype", ctypes.c_int32), ("head_w_stride", _i64), ("head_n", _i64), ("logits", _p),
                ("head_s", ctypes.c_double), ("tokens", _p), ("embed", _p), ("embed_dtype", ctypes.c_int32),
                ("embed_rows", _i64), ("embed_stride", _i64), ("norm0", _p), ("eps", ctypes.c_float),
                ("lanes", ctypes.c_int32), ("mtp_hidden", _p), ("mtp_enorm", _p), ("mtp_hnorm", _p),
                ("mtp_ctx", _p), ("mtp_eh_id", ctypes.c_int32), ("head_rows", _p), ("head_T", _i64)]

def _library_path() -> str:
    env = os.environ.get("KT_KERNELS_LIB")
    if env:
        return env
    found = sorted(glob.glob(str(Path(__file__).resolve().parent / "libktkernels*.so")))
    if not found:
        raise KernelError(f"libktkernels*.so not found in {Path(__file__).resolve().parent}: run `make kernels`")
    return found[0]


_LIB: ctypes.CDLL | None = None


def load_library() -> ctypes.CDLL:
    global _LIB
    if _LIB is not None:
        return _LIB
    path = _library_path()
    lib = ctypes.CDLL(path)
    c_int, c_p, c_i64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
    sigs = {
        "kt_abi_version": (c_int, []), "kt_last_error": (ctypes.c_char_p, []),
        "kt_backend_supported": (c_int, [ctypes.c_char_p]),
        "kt_create": (c_p, [c_int, c_int, ctypes.c_char_p]), "kt_destroy": (None, [c_p]),
        "kt_backend_name": (ctypes.c_char_p, [c_p]), "kt_backend_detail": (ctypes.c_char_p, [c_p]),
        "kt_n_threads": (c_int, [c_p]), "kt_n_pools": (c_int, [c_p]), "kt_pool_wake": (None, [c_p]),
        "kt_pool_rest": (None, [c_p]),
        "kt_thread_cpu": (c_int, [c_p, c_int]), "kt_thread_pool": (c_int, [c_p, c_int]),
        "kt_add_layer": (c_int, [c_p, c_int, c_int, c_int, c_int, c_int, c_int, c_int, ctypes.POINTER(_Piece)]),
        "kt_add_layer_ex": (c_int, [c_p, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int,
                                    ctypes.POINTER(_Piece)]),
        "kt_submit": (c_int, [c_p, c_int, c_int, c_p, c_int, c_i64, c_int, c_p, c_p, c_p, c_i64, c_int]),
        "kt_submit_masked": (c_int, [c_p, c_int, c_int, c_p, c_int, c_i64, c_int, c_p, c_p, c_p, c_i64, c_int, c_p]),
        "kt_submit_shared": (c_int, [c_p, c_int, c_int, c_p, c_int, c_i64, c_int, c_p, c_p, c_p, c_i64, c_int, c_p,
                                     c_int, c_p]),
        "kt_sync": (c_int, [c_p]),
        "kt_set_layer_activation": (c_int, [c_p, c_int, c_int, ctypes.c_float, ctypes.c_float, c_p, c_p, c_p]),
        "kt_profile": (c_int, [c_p, ctypes.POINTER(ctypes.c_double), c_int]),
        "kt_measure_read_bandwidth": (ctypes.c_double, [c_p, ctypes.c_size_t, c_int]),
        "kt_measure_int8_peak": (ctypes.c_double, [c_p, ctypes.c_double]),
        "kt_measure_tile_int8_peak": (ctypes.c_double, [c_p, ctypes.c_double]),
        "kt_rms_norm": (c_int, [c_i64, c_i64, c_p, c_i64, c_p, c_i64, c_p, c_i64, c_p, ctypes.c_float, c_int, c_p,
                                c_i64]),
        "kt_rope": (c_int, [c_i64, c_i64, c_i64, c_p, c_i64, c_i64, c_p, c_p, c_i64, c_int, c_p, c_i64, c_i64]),
        "kt_route_sigmoid": (c_int, [c_p, c_i64, c_i64, c_i64, c_p, c_i64, c_p, c_int, c_i64, c_p, c_i64, c_i64,
                                     c_i64, c_int, ctypes.c_float, c_p, c_p]),
        "kt_gqa_attend_batch": (c_int, [c_p, c_i64, c_i64, c_i64, c_i64, c_i64, c_p, c_i64, c_i64, ctypes.c_float,
                                        c_p, c_p, c_p, c_p, c_i64, c_i64, c_p, c_i64, c_i64]),
        "kt_gqa_decode": (c_int, [c_p, ctypes.POINTER(GqaDecodeArgs)]),
        "kt_prompt_attend": (c_int, [c_p, ctypes.POINTER(PromptAttendArgs)]),
        "kt_gqa_layer": (c_int, [c_p, ctypes.POINTER(GqaLayerArgs)]),
        "kt_mla_decode": (c_int, [c_p, ctypes.POINTER(MlaDecodeArgs)]),
        "kt_moe_decode": (c_int, [c_p, ctypes.POINTER(MoeDecodeArgs)]),
        "kt_decode_layers": (c_int, [ctypes.POINTER(DecodeLayersArgs)]),
        "kt_float_linear": (c_int, [c_p, c_i64, c_i64, c_i64, c_p, c_i64, c_p, c_int, c_i64, c_p, c_i64]),
        "kt_route_softmax": (c_int, [c_p, c_i64, c_i64, c_i64, c_p, c_i64, c_p, c_int, c_i64, c_i64, c_i64, c_i64,
                                     c_int, ctypes.c_float, c_p, c_p]),
        "kt_mla_attend": (c_int, [c_p, c_i64, c_i64, c_i64, c_p, c_i64, c_p, c_i64, ctypes.c_float, c_i64, c_p, c_p,
                                  c_i64, c_p, c_i64]),
        "kt_search_scales": (c_int, [c_i64, c_i64, c_p, c_i64, c_p, c_i64, c_int, c_int, c_p, c_int, c_int, c_p,
                                     c_p]),
        "kt_gptq_block": (c_int, [c_i64, c_i64, c_p, c_i64, c_p, c_i64, c_i64, c_int, c_p, c_int, c_int, c_p, c_int,
                                  c_int, c_p, c_i64, c_p, c_i64, c_p, c_i64]),
        "kt_mla_attend_batch": (c_int, [c_p, c_i64, c_i64, c_i64, c_i64, c_p, c_i64, c_i64, c_p, c_i64, c_i64,
                                        ctypes.c_float, c_p, c_p, c_p, c_i64, c_p, c_i64, c_i64]),
        # the dense Linear op (ktrun.ops.linear)
        "kt_add_linear": (c_int, [c_p, c_int, c_int, c_int, c_int, c_int, c_p, c_p]),
        "kt_add_linear_ex": (c_int, [c_p, c_int, c_int, c_int, c_int, c_int, c_int, c_p, c_p]),
        "kt_linear_submit": (c_int, [c_p, c_int, c_p, c_int, c_p, c_int, c_i64, c_p, c_p]),
        "kt_linear_submit_grouped": (c_int, [c_p, c_int, c_int, c_int, c_int, c_int, c_int, c_p, c_int, c_i64, c_i64,
                                             c_p, c_i64, c_i64]),
        "kt_linear_submit_grouped_scaled": (c_int, [c_p, c_int, c_int, c_int, c_int, c_int, c_int, c_p, c_int, c_i64,
                                                    c_i64, c_int, c_p, c_p, c_i64, c_i64]),
        "kt_linear_repack": (c_int, [c_p, c_int, c_int, c_int, c_int, c_p, c_int, c_i64, c_i64, c_p, c_i64, c_i64,
                                     c_p, c_p]),
        "kt_linear_repack_ex": (c_int, [c_p, c_int, c_int, c_int, c_int, c_p, c_int, c_i64, c_i64, c_p, c_i64, c_i64,
                                        c_p, c_p, c_int]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    if lib.kt_abi_version() != ABI_VERSION:
        raise KernelError(f"{path}: ABI version {lib.kt_abi_version()}, this module needs {ABI_VERSION}: run `make kernels`")
    _LIB = lib
    return lib


def backend_supported(name: str) -> bool:
    return bool(load_library().kt_backend_supported(name.encode()))


def _err(lib: ctypes.CDLL) -> str:
    return lib.kt_last_error().decode(errors="replace")


def _pointer(a: Any, what: str, dtype: np.dtype | None = None, contiguous: bool = True) -> int:
    """Address of a numpy array or CPU torch tensor (checked dtype / contiguity)."""
    if hasattr(a, "data_ptr"):   # torch
        if a.device.type != "cpu":
            raise ValueError(f"{what}: tensor is on {a.device}, the CPU kernels need CPU memory")
        if contiguous and not a.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous")
        return int(a.data_ptr())
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what}: expected a numpy array or torch tensor, got {type(a).__name__}")
    if dtype is not None and a.dtype != dtype:
        raise ValueError(f"{what}: dtype {a.dtype}, expected {np.dtype(dtype)}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous")
    return a.ctypes.data


def _dtype_name(a: Any) -> str:
    return str(getattr(a, "dtype", "")).replace("torch.", "")


def _shape(a: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in a.shape)


def last_level_cache_bytes() -> int:
    """This CPU's largest cache (Linux sysfs, cpu0's cache levels), bytes; 0 when unknown."""
    best, units = 0, {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        n = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size or 0)
        best = max(best, n)
    return best


def stream_probe_bytes() -> int:
    """Buffer size for a read-bandwidth probe: 4x the last-level cache, as the STREAM benchmark asks, at least 1 GiB,
    at most 4 GiB. On a host reporting a 480 MB L3, a 256 MB probe read 31.6-33.4 GB/s run to run (part of it served by
    the cache), 1-2 GB steadily 31.1-31.9 (bench_vs_llamacpp.py's roofline used 256 MB until then)."""
    return min(4 << 30, max(1 << 30, 4 * last_level_cache_bytes()))


def kernels_available() -> bool:
    """True when libktkernels loads on this machine with the ABI this module expects."""
    try:
        load_library()
    except (OSError, RuntimeError):   # missing library, ABI mismatch: the torch reference serves
        return False
    return True
