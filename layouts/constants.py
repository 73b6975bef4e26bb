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
SCALE_DTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "sub6": "U8"}     # --scale-dtype -> safetensors dtype
# bytes per (column, group): sub6 stores a 128-byte record per 16 columns x 8 groups, i.e. 1 byte per (column, group)
SCALE_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "sub6": 1}
# What `ktconvert quantize` writes without --scale-dtype: f16 (version 2). Chosen by measurement (bench/README.md,
# bench_quant_vs_llamacpp.py): the scale search picks float16 values even when it stores float32, so f16 gives the
# same KL as f32 at half the scale bytes; version-1 (f32) files keep loading, and --scale-dtype f32 still writes them.
DEFAULT_SCALE_DTYPE = "f16"
CPU_EXPERT_LAYOUT_VERSIONS = (1, 2, 3)
SCALE_DTYPES_OF_VERSION = {1: ("f32",), 2: ("f16", "bf16"), 3: ("sub6",)}      # int layouts: what each version stores

# Version 3, two-level scales (`--scale-dtype sub6`, cpu-expert-int4 only, group 32; README.md "Two-level scales"):
# per column and super-block of 8 groups (256 input channels) one float16 super-scale d, per group a signed 6-bit
# sub-scale q in [-32, 31]; the group's scale is d * q (exact in float32). 4 + 6/32 + 16/256 = 4.25 bits per weight.
SUB6_GROUP = 32                   # input channels per sub-scale (the group size)
SUB6_SUPER_GROUPS = 8             # groups per super-block (256 input channels)
SUB6_RECORD_BYTES = 128           # one (16-column block, super-block): 64 bytes low nibbles, 16 f16 d, 32 bytes high bits
SUB6_RANGE = (-32, 31)            # sub-scale codes (6-bit two's complement)
# The quantizers keep d to 6 significant bits: with |q| <= 32 (5 significant bits) every product d * q is then a
# float16 value (in float16's normal range), so GPU formats with float16 scales (Marlin hot experts) hold it exactly.
SUB6_SUPER_SIG_BITS = 6


def scale_layout_version(scale_dtype: str) -> int:
    """Layout version of int expert files with these scales: 1 for float32, 2 for 16-bit, 3 for two-level (sub6)."""
    return {"f32": 1, "sub6": 3}.get(scale_dtype, 2)


def scale_dtype_bits(scale_dtype: str) -> tuple[int, ...]:
    """The int layouts (bits) that store this scale dtype: two-level scales exist for int4 only."""
    return (4,) if scale_dtype == "sub6" else (4, 8)


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
