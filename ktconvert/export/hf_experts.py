"""Routed experts of a conversion, taken over losslessly into a GPU checkpoint format for `ktconvert export`.

The CPU tiles hold symmetric per-group codes with zero point 2^(bits-1) (ktlayouts.cpu_expert):
    W[n, k] = (code[n, k] - 2^(bits-1)) * scale[n, k // G]
which is exactly compressed-tensors' symmetric int quantization (pack-quantized) and GPTQ's sym=True, desc_act=False
(ktlayouts.compressed_tensors / ktlayouts.gptq). So the codes are unpacked from the tiles, cropped to the source
shape (N, K) and repacked by the registered GPU format (ktlayouts.gpu_formats); no value is re-quantized. Scales stay float32, as
the tiles store them (the layouts' usual float16 would round them).

Export group size ("step"): ktlayouts.expert_gpu.gpu_group_step (the largest of 128/64/32 that divides H and I and
stays inside the CPU groups, or one scale per row); a conversion without one is refused, pointing to --experts bf16.
The codes come out of the tiles with ktlayouts.expert_gpu.expert_codes, which ktrun's hot experts share.

transformers (5.24, CPU) keeps the dequantized experts in the scales' dtype (float32) even when loading with
dtype=bfloat16 (its fused-expert decompression does not cast, its dense path does); forward passes work.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from ktlayouts import expert_gpu
from ktlayouts.converted_dir import PROJECTIONS, expert_file, expert_tensor
from ktlayouts.cpu_expert import LayoutError
from ktlayouts.expert_gpu import GPU_STEPS
from ktlayouts.gptq import GptqGeometry
from ktlayouts.gpu_formats import GpuLinearFormat, gpu_format_for

from ktconvert.converted_reader import ConvertedDir, to_numpy

EXPORT_STEPS = GPU_STEPS               # the group lengths (besides per-row CHANNEL) vLLM's Marlin kernels take
# The per-expert Linears (model.layers.N.mlp.experts.E.gate_proj, Mixtral's block_sparse_moe.experts.E.w1), not
# shared_experts; spelled as a compressed-tensors target (re.match on the module name) and a gptq `dynamic` key.
EXPERT_LINEARS = r".*\.experts\.\d+\.[^.]+$"
EXPERT_TARGET_REGEX = gpu_format_for("compressed-tensors", 4).module_pattern(EXPERT_LINEARS, quantized=True)
EXPERT_DYNAMIC = gpu_format_for("gptq", 4).module_pattern(EXPERT_LINEARS, quantized=True)


class ExpertExportError(ValueError):
    """Routed experts that cannot be written in a GPU format without re-quantizing."""


def source_shape(conv: ConvertedDir, proj: str) -> tuple[int, int]:
    """(N, K) of the source Linear: gate/up (I, H), down (H, I)."""
    return expert_gpu.source_shape(conv.geometry, proj)


def exact_steps(conv: ConvertedDir) -> list[int]:
    """Every group length in EXPORT_STEPS that writes the experts exactly (divides K of every projection, and every
    step-long run of columns lies inside one CPU scale group), longest first."""
    groups = [expert_gpu.column_groups(conv.geometry, p) for p in PROJECTIONS]
    return [step for step in EXPORT_STEPS
            if all(len(g) % step == 0 and np.all(g.reshape(-1, step) == g.reshape(-1, step)[:, :1]) for g in groups)]


def export_step(conv: ConvertedDir) -> int:
    """The group length the export writes (CHANNEL for one scale per row); ExpertExportError if none is exact."""
    step = expert_gpu.gpu_group_step(conv.geometry)
    if step is not None:
        return step
    geo = conv.geometry
    raise ExpertExportError(
        f"the routed experts (group size {geo.group_size}, {geo.numa_nodes} NUMA shard(s), hidden {geo.hidden}, "
        f"intermediate {geo.intermediate}) have no group length in {EXPORT_STEPS} that divides both sizes and "
        "stays inside the CPU scale groups; export them with --experts bf16")


def expert_codes(conv: ConvertedDir, layer: int, expert: int, proj: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    """codes (N, K) uint8 (zero point 2^(bits-1)) and scales (N, K / step) float32 (N, 1) for CHANNEL of one expert
    projection in source shape, straight from the stored tiles."""
    shards = []
    for s in range(conv.geometry.numa_nodes):
        f = conv.open(expert_file(layer, s, conv.geometry.numa_nodes))
        shards.append((f.get_slice(expert_tensor(proj, "qweight"))[expert: expert + 1][0].numpy(),
                       to_numpy(f.get_slice(expert_tensor(proj, "scales"))[expert: expert + 1][0])))
    return expert_gpu.expert_codes(conv.geometry, proj, step, shards)


def gptq_geometry(conv: ConvertedDir, proj: str, step: int) -> GptqGeometry:
    n, k = source_shape(conv, proj)
    try:
        return expert_gpu.gptq_geometry(conv.geometry, proj, step)
    except LayoutError as e:
        raise ExpertExportError(f"routed expert {proj} ({n}, {k}): {e}; export the experts with --experts bf16") \
            from None


def _exporting(fmt: GpuLinearFormat) -> GpuLinearFormat:
    if fmt.quant_method is None:
        raise ExpertExportError(f"no quantized expert export for GPU format {fmt.family!r}")
    return fmt


def pack_expert(fmt: GpuLinearFormat, codes: np.ndarray, scales: np.ndarray, geom: GptqGeometry
                ) -> dict[str, np.ndarray]:
    """codes (N, K), scales (N, n_groups) float32 -> the Linear's tensors in `fmt` (suffix -> array), scales f32."""
    codes_kn, scales_gn = np.ascontiguousarray(codes.T), np.ascontiguousarray(scales.T)
    return _exporting(gpu_format_for(fmt.family, geom.bits)).pack(codes_kn, scales_gn, geom, scale_dtype=np.float32)


def quantized_expert_tensors(conv: ConvertedDir, adapter, fmt: GpuLinearFormat,
                             step: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Every routed expert Linear in `fmt`: (hub name of the part, array), e.g. ...experts.3.gate_proj.weight_packed.
    step: the export group length (default export_step; another exact one, see exact_steps, may be given)."""
    geo = conv.geometry
    if not geo.format.quantized:
        raise ExpertExportError(f"the conversion stores {geo.format.name.upper()} experts (--method {geo.method}); "
                                "export them with --experts bf16")
    step = export_step(conv) if step is None else step
    geoms = {p: gptq_geometry(conv, p, step) for p in PROJECTIONS}
    for layer in geo.moe_layers:
        for e in range(geo.n_experts):
            for p in PROJECTIONS:
                base = adapter.expert_tensor_name(layer, e, p).removesuffix(".weight")
                codes, scales = expert_codes(conv, layer, e, p, step)
                for suffix, arr in pack_expert(fmt, codes, scales, geoms[p]).items():
                    yield f"{base}.{suffix}", arr


def add_expert_scheme(qc: dict, fmt: GpuLinearFormat, bits: int, step: int) -> dict:
    """The exported quantization_config (a copy of `qc`, the GPU layers' own) plus the experts' scheme (the
    format's second scheme for the per-expert Linears: compressed-tensors a config group with a regex target,
    gptq a positive `dynamic` override with the experts' bits and group size)."""
    return _exporting(fmt).with_scheme(qc, EXPERT_LINEARS, bits, step)
