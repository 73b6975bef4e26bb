"""Format constants. Changing any value here is a format change: bump the matching version."""

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
# An Intel AMX B tile for TDPB[SU,SS,US,UU]D is 16 rows x 64 bytes; each 32-bit word of a row holds 4
# consecutive K values of one output column (VNNI order). So one tile covers K = 64, N = 16 for int8.
TILE_N = 16            # output columns per tile
TILE_K = 64            # input channels per int8 tile (16 rows x 4)
TILE_ROWS = 16         # rows of a B tile
TILE_ROW_BYTES = 64    # bytes per B tile row = one zmm register
VNNI_INT8 = 4          # K values per 32-bit word for int8
VNNI_BF16 = 2          # K values per 32-bit word for bf16 (TDPBF16PS / vdpbf16ps)

CPU_EXPERT_LAYOUTS = {
    # name: (bits, layout version written)
    "cpu-expert-int8": (8, 2),
    "cpu-expert-int4": (4, 2),
    "cpu-expert-bf16": (16, 1),
}
# Scales of the int layouts: version 1 stores them as float32; version 2 in 16 bits, float16 (the default) or
# bfloat16, named by the scales tensors' dtype and manifest experts.scale_dtype. Readers take both versions.
SCALE_DTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}     # --scale-dtype -> safetensors dtype
SCALE_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
# What `ktconvert quantize` writes without --scale-dtype: f16 (version 2). Chosen by measurement (bench/README.md,
# bench_quant_vs_llamacpp.py): the scale search picks float16 values even when it stores float32, so f16 gives the
# same KL as f32 at half the scale bytes; version-1 (f32) files keep loading, and --scale-dtype f32 still writes them.
DEFAULT_SCALE_DTYPE = "f16"
CPU_EXPERT_LAYOUT_VERSIONS = (1, 2)
SCALE_DTYPES_OF_VERSION = {1: ("f32",), 2: ("f16", "bf16")}      # int layouts: what each version stores


def scale_layout_version(scale_dtype: str) -> int:
    """Layout version of int expert files with these scales: 1 for float32, 2 for 16-bit."""
    return 1 if scale_dtype == "f32" else 2


METHOD_TO_LAYOUT = {"int8-amx": "cpu-expert-int8", "int4-amx": "cpu-expert-int4", "bf16": "cpu-expert-bf16"}

# Weight codes are unsigned with a fixed zero point (uint8b128 / uint4b8): value = (code - ZERO) * scale.
# Unsigned weights let vpdpbusd / TDPBSUD take them directly against signed int8 activations.
ZERO_POINT = {8: 128, 4: 8}
# Defaults of `ktconvert quantize` (measured against llama.cpp's Q4_K_M on the default model, bench/README.md):
# routed experts int4 group 64 with f16 scales = 4.25 bits/weight, the same bytes as the earlier group 128 with f32
# scales (the kernels' decode time: bench_moe_kernels.py --group), GPU layers group 32 (Marlin, GPTQ and
# compressed-tensors all take it).
DEFAULT_GROUP_SIZE = 64
DEFAULT_GPU_GROUP_SIZE = 32
GROUP_PER_ROW = -1     # --group-size -1 (or K): one scale per output row, kt-kernel's scheme

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
