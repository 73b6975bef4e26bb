"""Place the GPU-quantized Linears of a conversion on the compute device, by policy (`--gpu-weights`):

  dequant  dequantize every quantized Linear once at load (ktlayouts.gpu_formats, float32 on the CPU, then cast):
           fastest per token, 4x (int4) the device memory of the packed weights.
  packed   Marlin-layout Linears stay packed on the device as ktrun.ops.packed_linear.MarlinLinear: an installed
           Marlin GEMM (ktrun.ops.marlin) reads them in place. Without one, on CUDA, every quantized Linear (Marlin,
           gptq with act order, compressed-tensors) is repacked once into the GPTQ layout as
           ktrun.ops.triton_linear.TritonLinear and run by ktrun's own Triton kernel (torch + Triton, nothing else);
           without Triton (or with KTRUN_TRITON=off) Marlin layers dequantize themselves per call and the other
           layouts are dequantized at load.
  kernels  CPU only: every quantized Linear is repacked once at load into cpu-linear tiles and run by libktkernels'
           dense Linear op on the experts' thread pool (ktrun.ops.kernel_linear): int4/int8 weights read per token, no
           float copy (act-order g_idx: the codes' rows and each call's input permuted by group). Linears the op
           cannot hold exactly (groups of other sizes than G) are dequantized at load.
  auto     CPU: kernels when libktkernels loads, else dequant.  CUDA: packed when a Marlin kernel is installed or
           Triton runs; otherwise dequant if the dequantized weights take at most half of the free device memory,
           else packed (dequantized per call).
"""
from __future__ import annotations

import numpy as np
import torch
from ktlayouts.cpu_expert import LayoutError
from ktlayouts.gpu_formats import GpuLinearFormat, dequantize_named, gpu_format, linear_parts, quantized_linears

from .defaults import GPU_WEIGHT_POLICIES
from .ops.marlin import find_marlin_kernel
from .ops.packed_linear import MarlinLinear
from .ops.triton_linear import TritonLinear, use_triton


class PlacementError(ValueError):
    """A quantized tensor ktrun cannot place; the message names the file and tensor."""


def _dequantized(group: dict, where: str) -> dict[str, torch.Tensor]:
    """Quantized tensors of one file {name: (array, manifest entry)} -> {hub weight name: float32 (N, K) tensor}."""
    arrays = {n: np.asarray(a) for n, (a, _t) in group.items()}
    layouts = {n: t["layout"] for n, (_a, t) in group.items()}
    linears = quantized_linears(arrays, layouts)
    claimed = {n for w in linears for n in arrays if n.startswith(w[: -len("weight")])}
    stray = sorted(set(arrays) - claimed)
    if stray:
        raise PlacementError(f"{where}: tensors {stray[:3]} have layouts {sorted({layouts[n] for n in stray})} "
                             "that ktrun cannot read")
    out = {}
    for weight, layout in linears.items():
        try:
            out[weight] = torch.from_numpy(dequantize_named(layout, arrays, weight))
        except LayoutError as e:
            raise PlacementError(f"{where}: {e}") from None
    return out


def _linear_parts(group: dict, marlin_only: bool = False) -> dict[str, tuple[GpuLinearFormat, dict[str, np.ndarray]]]:
    """{hub weight name: (format, {suffix: array})} of the quantized Linears of one file; marlin_only: those whose
    format a Marlin GEMM reads in place (GpuLinearFormat.kernel == "marlin")."""
    linears = quantized_linears(group, {n: t["layout"] for n, (_a, t) in group.items()})
    arrays = {n: a for n, (a, _t) in group.items()}
    return {weight: (gpu_format(layout), {p: np.asarray(a) for p, a in linear_parts(layout, arrays, weight).items()})
            for weight, layout in linears.items() if not marlin_only or gpu_format(layout).kernel == "marlin"}


def _stored(weight: str, fmt: GpuLinearFormat, parts: dict, where: str):
    """(stored GptqGeometry, logical (N, K)) of a Marlin Linear from its parts' shapes; PlacementError naming it."""
    qw, sc = parts.get("qweight"), parts.get("scales")
    if qw is None or sc is None:
        raise PlacementError(f"{where}: {weight} ({fmt.name}) needs qweight and scales")
    try:
        return fmt.stored_geometry(parts, weight)
    except LayoutError as e:
        raise PlacementError(f"{where}: {weight}: qweight {list(qw.shape)}, scales {list(sc.shape)} and "
                             f"weight_shape do not fit together: {e}") from None


def _packed(weight: str, fmt: GpuLinearFormat, parts: dict, device, dtype, kernel, where: str) -> MarlinLinear:
    qw, sc = parts["qweight"], parts["scales"]
    geom, (n, k) = _stored(weight, fmt, parts, where)
    use = kernel if kernel is not None and kernel.supports(fmt.bits, geom.group_size, dtype) else None
    return MarlinLinear(weight, torch.from_numpy(np.array(qw)).to(device), torch.from_numpy(np.array(sc)).to(device),
                        fmt.bits, n, k, dtype, kernel=use)


def _triton(weight: str, fmt: GpuLinearFormat, parts: dict, device, dtype, where: str) -> TritonLinear:
    """Any registered GPU format's Linear as a TritonLinear: Marlin repacked on the device (torch), the others
    unpacked on the host by ktlayouts (act-order g_idx kept)."""
    try:
        if fmt.kernel == "marlin":
            return TritonLinear.from_marlin(_packed(weight, fmt, parts, device, dtype, None, where))
        return TritonLinear.from_unpacked(weight, fmt.unpack(parts, weight), fmt.bits, device, dtype)
    except LayoutError as e:
        raise PlacementError(f"{where}: {e}") from None


def use_cpu_kernels(policy: str, device: torch.device) -> bool:
    """Whether the quantized Linears go to the CPU dense Linear op (ktrun.ops.kernel_linear) under this policy."""
    if policy not in GPU_WEIGHT_POLICIES:
        raise PlacementError(f"--gpu-weights {policy!r}: expected one of {', '.join(GPU_WEIGHT_POLICIES)}")
    if policy == "kernels":
        if device.type != "cpu":
            raise PlacementError(f"--gpu-weights kernels runs the Linears on the CPU kernels, but the device is "
                                 f"{device}: use --device cpu, or packed / dequant")
        from .ops.library import kernels_available
        if not kernels_available():
            raise PlacementError("--gpu-weights kernels: libktkernels does not load here (run `make kernels`)")
        return True
    if policy == "auto" and device.type == "cpu":
        from .ops.library import kernels_available
        return kernels_available()
    return False


def choose_policy(policy: str, device: torch.device, dequantized_bytes: int) -> tuple[str, object]:
    """-> ('packed' | 'dequant', MarlinKernel or None) for this device, for the Linears not on the CPU kernels."""
    if policy not in GPU_WEIGHT_POLICIES:
        raise PlacementError(f"--gpu-weights {policy!r}: expected one of {', '.join(GPU_WEIGHT_POLICIES)}")
    if policy == "kernels":
        return "dequant", None
    kernel = find_marlin_kernel(device)
    if policy != "auto":
        return policy, kernel
    if device.type != "cuda":
        return "dequant", None
    if kernel is not None or use_triton(device, marlin_found=False):
        return "packed", kernel
    free, _total = torch.cuda.mem_get_info(device)
    return ("dequant" if dequantized_bytes <= free // 2 else "packed"), None


def place_quantized(quantized: dict[str, dict], device: torch.device, dtype: torch.dtype, policy: str = "auto",
                    linear_kernels=None) -> tuple[dict[str, object], str]:
    """quantized: {file (for errors): {name: (array, manifest entry)}} -> ({hub weight name: tensor, MarlinLinear or
    KernelLinear}, a one-line description of what was done, for logs and `ktrun bench`).
    linear_kernels: a ktrun.ops.linear.LinearKernels when use_cpu_kernels(policy, device) (the loader makes it)."""
    if linear_kernels is not None:
        from .ops.kernel_linear import place_on_kernels
        try:
            on_kernels, quantized, st = place_on_kernels(quantized, linear_kernels, dtype)
        except LayoutError as e:
            raise PlacementError(str(e)) from None
        rest, _how = place_quantized(quantized, device, dtype, "dequant") if quantized else ({}, "")
        how = (f"{st['linears']} Linears on the CPU kernels ({linear_kernels.backend}, {st['bytes'] / 1e6:.1f} MB "
               f"repacked in {st['seconds']:.2f} s)" + (f", {len(rest)} dequantized at load" if rest else ""))
        return {**rest, **on_kernels}, how if on_kernels or rest else "none quantized"
    marlin = {w: (where, fmt, parts) for where, group in quantized.items()
              for w, (fmt, parts) in _linear_parts(group, marlin_only=True).items()}
    stored = [_stored(w, fmt, p, where)[0] for w, (where, fmt, p) in marlin.items()]
    nbytes = sum(g.n * g.k for g in stored) * torch.finfo(dtype).bits // 8
    mode, kernel = choose_policy(policy, device, nbytes)
    if mode == "packed" and use_triton(device, marlin_found=kernel is not None):
        return _place_on_triton(quantized, device, dtype)
    out: dict[str, object] = {}
    for where, group in quantized.items():
        packed_here = {w for w, (wh, _l, _p) in marlin.items() if wh == where} if mode == "packed" else set()
        rest = {n: v for n, v in group.items() if not any(n.startswith(w[: -len("weight")]) for w in packed_here)}
        if rest:
            for name, t in _dequantized(rest, where).items():
                out[name] = t.to(device=device, dtype=dtype)
        for w in packed_here:
            _where, fmt, parts = marlin[w]
            out[w] = _packed(w, fmt, parts, device, dtype, kernel, where)
    packed = [v for v in out.values() if isinstance(v, MarlinLinear)]
    if not packed:
        return out, "dequantized at load" if out else "none quantized"
    n_kernel = sum(v.kernel is not None for v in packed)
    how = f"Marlin kernel ({kernel.provider})" if n_kernel == len(packed) else \
        "dequantized per call" if n_kernel == 0 else f"Marlin kernel for {n_kernel}/{len(packed)}, rest per call"
    return out, f"{len(packed)} Linears packed, {how}"


def _place_on_triton(quantized: dict[str, dict], device: torch.device, dtype: torch.dtype
                     ) -> tuple[dict[str, object], str]:
    """Every quantized Linear of every file as a TritonLinear (place_quantized's packed mode with Triton)."""
    out = {weight: _triton(weight, fmt, parts, device, dtype, where)
           for where, group in quantized.items() for weight, (fmt, parts) in _linear_parts(group).items()}
    acts = sum(v.g_idx is not None for v in out.values())
    return out, (f"{len(out)} Linears packed, Triton kernel" + (f" ({acts} act-order)" if acts else "")
                 if out else "none quantized")
