"""Format constants. Changing any value here is a format change: bump the matching version.

The CPU expert formats are records in expert_formats.py; their tables here are derived from the records."""

from .expert_formats import (
    DEFAULT_SCALE_DTYPE,
    GROUP_PER_ROW,
    SUB6_GROUP,
    SUB6_RANGE,
    SUB6_RECORD_BYTES,
    SUB6_SUPER_GROUPS,
    SUB6_SUPER_SIG_BITS,
    TILE_K,
    TILE_N,
    TILE_ROW_BYTES,
    TILE_ROWS,
    VNNI_BF16,
    VNNI_INT8,
)
from .expert_formats import expert_formats as _formats
from .expert_formats import layout_versions as _layout_versions
from .expert_formats import scale_encoding as _scale_encoding
from .expert_formats import scale_encodings as _scales

# The records' shared constants (tiles, group per row, two-level scale parameters, the default scale dtype) are
# defined in expert_formats.py and named here too.
__all__ = [
    "ACT_QMAX", "CPU_EXPERT_LAYOUTS", "CPU_EXPERT_LAYOUT_VERSIONS", "CPU_LINEAR_LAYOUTS", "DEFAULT_GPU_GROUP_SIZE",
    "DEFAULT_GROUP_SIZE", "DEFAULT_SCALE_DTYPE", "FILE_ALIGN", "FORMAT_VERSION", "GROUP_PER_ROW", "META_FORMAT_VERSION",
    "META_LAYOUT", "META_LAYOUT_VERSION", "METHOD_TO_LAYOUT", "SCALE_DTYPES", "SCALE_DTYPES_OF_VERSION",
    "SCALE_DTYPE_BYTES", "SUB6_GROUP", "SUB6_RANGE", "SUB6_RECORD_BYTES", "SUB6_SUPER_GROUPS", "SUB6_SUPER_SIG_BITS",
    "TILE_K", "TILE_N", "TILE_ROWS", "TILE_ROW_BYTES", "VNNI_BF16", "VNNI_INT8", "ZERO_POINT", "default_group_size",
    "scale_dtype_bits", "scale_layout_version",
]

# manifest.json "format_version"; ktrun refuses manifests from a newer major version.
FORMAT_VERSION = 1

# safetensors metadata keys written into every file we produce.
META_LAYOUT = "kt.layout"            # e.g. "cpu-expert-int4"
META_LAYOUT_VERSION = "kt.layout_version"
META_FORMAT_VERSION = "kt.format_version"

# Every tensor starts at a multiple of this many bytes from the start of its file, so kernels can
# read tiles straight from the mapped file with aligned 64-byte (one zmm / one AMX tile row) loads.
FILE_ALIGN = 64

# --- CPU expert layouts (routed experts, read in place by kernels/) -------------------------------
# Every format is one record in expert_formats.py (layout name, bits, zero point, scale encodings, versions, --method
# names, verify limits, kernel ABI codes); the tables below are DERIVED from those records, kept for their readers.
# name: (bits, layout version written by default)
CPU_EXPERT_LAYOUTS = {f.layout: (f.bits, f.layout_version()) for f in _formats()}
# --scale-dtype -> safetensors dtype of the scales tensors
SCALE_DTYPES = {r.name: r.safetensors_dtype for r in _scales()}
# bytes per (column, group): sub6 stores a 128-byte record per 16 columns x 8 groups, i.e. 1 byte per (column, group)
SCALE_DTYPE_BYTES = {r.name: r.nbytes for r in _scales()}
CPU_EXPERT_LAYOUT_VERSIONS = _layout_versions()
# int layouts: what each version stores
SCALE_DTYPES_OF_VERSION = {v: tuple(r.name for r in _scales() if r.layout_version == v)
                           for v in sorted({r.layout_version for r in _scales()})}


def scale_layout_version(scale_dtype: str) -> int:
    """Layout version of int expert files with these scales: 1 for float32, 2 for 16-bit, 3 for two-level (sub6)."""
    return _scale_encoding(scale_dtype).layout_version


def scale_dtype_bits(scale_dtype: str) -> tuple[int, ...]:
    """The int layouts (bits) that store this scale dtype: two-level scales exist for int4 only."""
    return _scale_encoding(scale_dtype).weight_bits()


METHOD_TO_LAYOUT = {m: f.layout for f in _formats() for m in f.methods}

# Weight codes are unsigned with a fixed zero point (uint8b128 / uint4b8): value = (code - ZERO) * scale.
# Unsigned weights let vpdpbusd / TDPBSUD take them directly against signed int8 activations.
ZERO_POINT = {f.bits: f.zero_point for f in _formats() if f.quantized}
# Defaults of `ktconvert quantize` (measured against llama.cpp's Q4_K_M on the default model, bench/README.md):
# routed experts int4 group 64 with f16 scales = 4.25 bits/weight, the same bytes as the earlier group 128 with f32
# scales (the kernels' decode time: bench_moe_kernels.py --group), GPU layers group 32 (Marlin, GPTQ and
# compressed-tensors all take it).
DEFAULT_GROUP_SIZE = 64
DEFAULT_GPU_GROUP_SIZE = 32


def default_group_size(scale_dtype: str) -> int:
    """The expert group `ktconvert quantize` writes with these scales when --group-size is left open: the scale
    encoding's own group (two-level sub6: 32), else DEFAULT_GROUP_SIZE."""
    return _scale_encoding(scale_dtype).fixed_group or DEFAULT_GROUP_SIZE

# Activation quantization used by the int kernels (documented in README.md): int8, symmetric,
# one scale per token per weight group, scale = max|x_g| / 127, round half to even.
ACT_QMAX = 127

# --- CPU dense Linear layouts (non-expert Linears on the CPU: libktkernels' linear op, cpu_linear.py) ----------
# One (N, K) Linear in exactly the tiles and float32 group scales of ONE cpu-expert-int4/int8 matrix (same
# MatrixGeometry); quantization as the GPU layers' (symmetric, zero point 2^(bits-1), G = 32/64/128/-1), so GPU codes
# repack into it without requantization.
CPU_LINEAR_LAYOUTS = {
    # name: (bits, layout version)
    "cpu-linear-int8": (8, 1),
    "cpu-linear-int4": (4, 1),
}
