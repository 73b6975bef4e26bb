"""The CPU routed-expert formats, one record each, registered once (spec: README.md "CPU expert layouts").

As gguf-py registers a quant type once (one enum entry, one size row, one quant class), every CPU expert format is
one frozen record here, and every table about them (ktlayouts.constants' CPU_EXPERT_LAYOUTS, SCALE_DTYPES, ...,
`--method` / `--scale-dtype` choices, `ktconvert verify`'s limits, `ktconvert inspect`'s bytes, ktrun.ops' kernel ABI
codes) is derived from the registry, never written out again. Two kinds of records:

- `ExpertFormat`: how the weights are stored (`cpu-expert-int8`, `cpu-expert-int4`, `cpu-expert-bf16`): bits, the
  codes' zero point, the tile packing, `--method` name(s), layout name and version, group rule, verify limits.
- `ScaleEncoding`: how the scales of a quantized format are stored (`--scale-dtype f32 | f16 | bf16 | sub6`): the
  safetensors dtype, bytes per (column, group), the layout version it makes, its group rule (sub6: group 32, K padded
  to whole super-blocks), and the kernel ABI code of the dtype (kernels/src/scale_types.h, KT_* in ktkernels.h).

A record names its reference pack/unpack by `packing`: ktlayouts.cpu_expert registers one codec class per packing
(`WeightCodec` / `ScaleCodec` subclasses), so adding a format is one record here, its reference pack/unpack there
(or an existing packing's name), and its kernel body (README.md "Adding an expert format").

This module imports nothing else of ktlayouts (ktlayouts.constants derives its tables from it).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass


class LayoutError(ValueError):
    """A shape or parameter that the layout cannot represent."""


# --- the AMX tiles every CPU expert format shares ---------------------------------------------------------------
# An Intel AMX B tile for TDPB[SU,SS,US,UU]D is 16 rows x 64 bytes; each 32-bit word of a row holds 4
# consecutive K values of one output column (VNNI order). So one tile covers K = 64, N = 16 for int8.
TILE_N = 16            # output columns per tile
TILE_K = 64            # input channels per int8 tile (16 rows x 4)
TILE_ROWS = 16         # rows of a B tile
TILE_ROW_BYTES = 64    # bytes per B tile row = one zmm register
VNNI_INT8 = 4          # K values per 32-bit word for int8
VNNI_BF16 = 2          # K values per 32-bit word for bf16 (TDPBF16PS / vdpbf16ps)
GROUP_PER_ROW = -1     # --group-size -1 (or K): one scale per output row, kt-kernel's scheme

# Two-level scales (`--scale-dtype sub6`, cpu-expert-int4 layout version 3, group 32; README.md "Two-level scales"):
# per column and super-block of 8 groups (256 input channels) one float16 super-scale d, per group a signed 6-bit
# sub-scale q in [-32, 31]; the group's scale is d * q (exact in float32). 4 + 6/32 + 16/256 = 4.25 bits per weight.
SUB6_GROUP = 32                   # input channels per sub-scale (the group size)
SUB6_SUPER_GROUPS = 8             # groups per super-block (256 input channels)
SUB6_RECORD_BYTES = 128           # one (16-column block, super-block): 64 bytes low nibbles, 16 f16 d, 32 bytes high bits
SUB6_RANGE = (-32, 31)            # sub-scale codes (6-bit two's complement)
# The quantizers keep d to 6 significant bits: with |q| <= 32 (5 significant bits) every product d * q is then a
# float16 value (in float16's normal range), so GPU formats with float16 scales (Marlin hot experts) hold it exactly.
SUB6_SUPER_SIG_BITS = 6


@dataclass(frozen=True)
class ScaleEncoding:
    """How the group scales of a quantized expert format are stored (one `--scale-dtype`)."""
    name: str                    # --scale-dtype, manifest experts.scale_dtype, MatrixGeometry.scale_dtype
    what: str                    # in messages: "float16", "two-level scales"
    safetensors_dtype: str       # dtype of the `*.scales` tensors
    nbytes: int                  # bytes per (column, group) (sub6: a 128-byte record per 16 columns x 8 groups)
    layout_version: int          # the int layouts' version whose scales these are
    packing: str                 # the reference pack/unpack (a ktlayouts.cpu_expert.ScaleCodec registered under it)
    array_dtype: str             # numpy dtype of the packed scales (pack_scales' output; bfloat16: its uint16 bits)
    runtime_name: str            # ktrun.ops' name of scale arrays in it (a torch dtype's name; two-level: its own)
    abi_name: str                # the kernels' names: kt::kScale<abi_name> (scale_types.h), KT_<ABI_NAME> (ktkernels.h)
    abi_code: int                # their value: the scale dtype argument of kt_add_layer_ex / kt_add_linear_ex
    elementwise: bool = True     # every group's scale is stored on its own, as a value (rounded value by value)
    finite_max: float | None = None       # largest magnitude it holds (float16: 65504); None: any float32 scale
    dense_linear: bool = False            # the kernels' dense Linear op reads it too (cpu-linear layouts)
    bits: tuple[int, ...] | None = None   # weight bits it is written with; None: every quantized format
    fixed_group: int | None = None        # the one group size it takes; None: every group the format takes
    super_groups: int = 1                 # groups stored together along K (sub6: 8): K pads to lcm(64, this x G)

    def weight_bits(self) -> tuple[int, ...]:
        """The quantized formats (bits) that store these scales."""
        return self.bits if self.bits is not None else tuple(sorted(f.bits for f in expert_formats() if f.quantized))

    def check(self, bits: int, group_size: int) -> None:
        """LayoutError naming the flags when a bits-bit format with this group size cannot store these scales."""
        if bits in self.weight_bits() and self.fixed_group in (None, group_size):
            return
        fmts = [f for f in expert_formats() if f.bits in self.weight_bits()]
        need = (f"{' or '.join(f.name for f in fmts)} (--method {' or '.join(f.method for f in fmts)})"
                + ("" if self.fixed_group is None else f" and --group-size {self.fixed_group}"))
        raise LayoutError(f"{self.what} (--scale-dtype {self.name}) need {need}, got {bits}-bit group {group_size}")


@dataclass(frozen=True)
class ExpertFormat:
    """How the weights of a routed expert are stored (one `--method`, one layout name)."""
    name: str                    # in messages and help: "int4"
    layout: str                  # kt.layout of the expert files, manifest experts.layout
    methods: tuple[str, ...]     # `ktconvert quantize --method` names; the first is the one manifests record
    bits: int                    # bits per weight (16: bfloat16, not quantized)
    packing: str                 # the reference pack/unpack (a ktlayouts.cpu_expert.WeightCodec registered under it)
    vnni: int                    # K values per 32-bit word of a tile row: a tile covers 16 x vnni input channels
    zero_point: int | None       # code of weight 0 (uint8b128, uint4b8); None: not quantized, no scales
    max_rel_error: float         # `ktconvert verify --against`'s default limit on ||W_hat - W|| / ||W|| per tensor
    gptq_max_rel_error: float | None = None   # ... for experts quantized by GPTQ (weight error traded for output error)
    version: int | None = None   # layout version; None for quantized formats: their scale encoding's
    group_sizes: tuple[int, ...] = (GROUP_PER_ROW, 32)   # group sizes besides the multiples of group_multiple
    group_multiple: int = TILE_K

    @property
    def method(self) -> str:
        return self.methods[0]

    @property
    def quantized(self) -> bool:
        return self.zero_point is not None

    @property
    def k_per_tile(self) -> int:
        return TILE_ROWS * self.vnni

    @property
    def tile_bytes(self) -> int:
        return TILE_N * self.k_per_tile * self.bits // 8

    def layout_version(self, scale_dtype: str | None = None) -> int:
        """Version of the files written with these scales (default: DEFAULT_SCALE_DTYPE's, the current one)."""
        if not self.quantized:
            return self.version
        return scale_encoding(DEFAULT_SCALE_DTYPE if scale_dtype is None else scale_dtype).layout_version

    def scale_dtype_of(self, scale_dtype: str) -> str:
        """The scale dtype a geometry of this format carries: its own for quantized formats, else the undeclared one
        (no scales are stored)."""
        return scale_dtype if self.quantized else UNDECLARED_SCALE_DTYPE

    def check_group_size(self, group_size: int) -> None:
        if group_size in self.group_sizes or (group_size > 0 and group_size % self.group_multiple == 0):
            return
        allowed = [str(g) for g in self.group_sizes if g != GROUP_PER_ROW]
        raise LayoutError(f"group size {group_size} is not supported: use {', '.join(allowed)}, a multiple of "
                          f"{self.group_multiple}, or {GROUP_PER_ROW} (per row)")

    def check(self, group_size: int, scale_dtype: str) -> None:
        """LayoutError naming the flags for a group size or scale dtype this format cannot store (unquantized formats
        have neither: any is ignored)."""
        if self.quantized:
            self.check_group_size(group_size)
            scale_encoding(scale_dtype).check(self.bits, group_size)


# --- the registry -------------------------------------------------------------------------------------------------

_SCALES: dict[str, ScaleEncoding] = {}
_FORMATS: dict[str, ExpertFormat] = {}


def register(record):
    """Add one ScaleEncoding or ExpertFormat; refuses a name, method, bits or ABI code that is already taken."""
    if isinstance(record, ScaleEncoding):
        clash = [r.name for r in _SCALES.values() if record.name == r.name or record.abi_code == r.abi_code
                 or record.abi_name == r.abi_name or record.runtime_name == r.runtime_name]
        table = _SCALES
        key = record.name
    elif isinstance(record, ExpertFormat):
        clash = [r.layout for r in _FORMATS.values() if record.layout == r.layout or record.bits == r.bits
                 or set(record.methods) & set(r.methods)]
        table = _FORMATS
        key = record.layout
    else:
        raise TypeError(f"not an expert format record: {record!r}")
    if clash:
        raise ValueError(f"{key}: name, method, bits or ABI code already registered by {clash}")
    table[key] = record
    return record


def unregister(record) -> None:
    """Remove a record again (a temporary registration, tests/test_adding_a_format.py)."""
    table = _SCALES if isinstance(record, ScaleEncoding) else _FORMATS
    key = record.name if isinstance(record, ScaleEncoding) else record.layout
    if table.get(key) is record:
        del table[key]


@contextmanager
def registered(*records):
    """Records registered for the duration of a with block."""
    done = []
    try:
        for r in records:
            done.append(register(r))
        yield records
    finally:
        for r in reversed(done):
            unregister(r)


def scale_encodings() -> tuple[ScaleEncoding, ...]:
    return tuple(_SCALES.values())


def expert_formats() -> tuple[ExpertFormat, ...]:
    return tuple(_FORMATS.values())


def scale_encoding(name: str) -> ScaleEncoding:
    """By --scale-dtype name (f32, f16, bf16, sub6)."""
    try:
        return _SCALES[name]
    except (KeyError, TypeError):
        raise LayoutError(f"scale dtype {name!r} is not one of {sorted(_SCALES)}") from None


def scale_encoding_of_array(dtype_name: str) -> ScaleEncoding:
    """By the dtype name of an array of stored scales: a torch dtype (float32, float16, bfloat16), a numpy dtype
    (uint16: bfloat16 bit patterns, uint8: two-level records), or the runtime name (sub6)."""
    for r in _SCALES.values():
        if dtype_name in (r.runtime_name, r.array_dtype):
            return r
    raise LayoutError(f"no scale dtype is stored as {dtype_name!r}")


def scale_encodings_of_version(version: int) -> tuple[ScaleEncoding, ...]:
    """The scale encodings an int layout of this version stores."""
    return tuple(r for r in _SCALES.values() if r.layout_version == version)


def expert_format(layout: str) -> ExpertFormat:
    """By layout name (cpu-expert-int4)."""
    try:
        return _FORMATS[layout]
    except (KeyError, TypeError):
        raise LayoutError(f"layout {layout!r} is not one of {sorted(_FORMATS)}") from None


def expert_format_of_method(method: str) -> ExpertFormat:
    """By --method name (int4-amx)."""
    for f in _FORMATS.values():
        if method in f.methods:
            return f
    raise LayoutError(f"--method {method!r} is not one of {', '.join(methods())}")


def expert_format_of_bits(bits: int) -> ExpertFormat:
    for f in _FORMATS.values():
        if f.bits == bits:
            return f
    *most, last = sorted(f.bits for f in _FORMATS.values())
    raise LayoutError(f"bits must be {', '.join(map(str, most))} or {last}, got {bits}")


def layout_records(layout: str, version: int) -> tuple[ExpertFormat, tuple[ScaleEncoding, ...]]:
    """By layout name and version: the format and the scale encodings files of that version hold (none unquantized);
    LayoutError for a version the format does not have."""
    fmt = expert_format(layout)
    encs = tuple(r for r in scale_encodings_of_version(version) if fmt.bits in r.weight_bits()) if fmt.quantized \
        else ()
    if (fmt.quantized and not encs) or (not fmt.quantized and version != fmt.version):
        raise LayoutError(f"{layout} has no layout version {version}")
    return fmt, encs


def methods() -> tuple[str, ...]:
    """Every --method name, in registry order."""
    return tuple(m for f in _FORMATS.values() for m in f.methods)


def layout_versions() -> tuple[int, ...]:
    """Every layout version a reader takes."""
    return tuple(sorted({r.layout_version for r in _SCALES.values()}
                        | {f.version for f in _FORMATS.values() if not f.quantized}))


# --- the records --------------------------------------------------------------------------------------------------

INT8 = register(ExpertFormat(name="int8", layout="cpu-expert-int8", methods=("int8-amx",), bits=8, packing="int-tiles",
                             vnni=VNNI_INT8, zero_point=128, max_rel_error=0.01, gptq_max_rel_error=0.02))
INT4 = register(ExpertFormat(name="int4", layout="cpu-expert-int4", methods=("int4-amx",), bits=4, packing="int-tiles",
                             vnni=VNNI_INT8, zero_point=8, max_rel_error=0.15, gptq_max_rel_error=0.25))
BF16 = register(ExpertFormat(name="bf16", layout="cpu-expert-bf16", methods=("bf16",), bits=16, packing="bf16-tiles",
                             vnni=VNNI_BF16, zero_point=None, max_rel_error=0.005, version=1))

# Scales of the int layouts: version 1 stores them as float32; version 2 in 16 bits, float16 (the default) or
# bfloat16, named by the scales tensors' dtype and manifest experts.scale_dtype; version 3 two-level records.
F32_SCALES = register(ScaleEncoding(
    name="f32", what="float32", safetensors_dtype="F32", nbytes=4, layout_version=1, packing="float",
    array_dtype="float32", runtime_name="float32", abi_name="F32", abi_code=0, dense_linear=True))
F16_SCALES = register(ScaleEncoding(
    name="f16", what="float16", safetensors_dtype="F16", nbytes=2, layout_version=2, packing="float",
    array_dtype="float16", runtime_name="float16", abi_name="F16", abi_code=2, finite_max=65504.0, dense_linear=True))
BF16_SCALES = register(ScaleEncoding(
    name="bf16", what="bfloat16", safetensors_dtype="BF16", nbytes=2, layout_version=2, packing="bf16-bits",
    array_dtype="uint16", runtime_name="bfloat16", abi_name="BF16", abi_code=1))
SUB6_SCALES = register(ScaleEncoding(
    name="sub6", what="two-level scales", safetensors_dtype="U8", nbytes=1, layout_version=3, packing="two-level",
    array_dtype="uint8", runtime_name="sub6", abi_name="Sub6", abi_code=3, elementwise=False, bits=(INT4.bits,),
    fixed_group=SUB6_GROUP, super_groups=SUB6_SUPER_GROUPS))

# What `ktconvert quantize` writes without --scale-dtype: f16 (version 2). Chosen by measurement (bench/README.md,
# bench_quant_vs_llamacpp.py): the scale search picks float16 values even when it stores float32, so f16 gives the
# same KL as f32 at half the scale bytes; version-1 (f32) files keep loading, and --scale-dtype f32 still writes them.
DEFAULT_SCALE_DTYPE = F16_SCALES.name
# What `ktconvert quantize` writes without --method.
DEFAULT_METHOD = INT4.method
# What files, manifests and geometries that name no scale dtype hold: version 1's float32 (and the unquantized
# formats' geometries, which store no scales).
UNDECLARED_SCALE_DTYPE = F32_SCALES.name
