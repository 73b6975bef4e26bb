"""GPU Linear formats: one registry, layout name -> format object (as gguf-py registers each quant type once).

A quantized GPU Linear W (N, K) (hub name `X.weight`) is stored as a few tensors `X.<suffix>` ("parts") with the
layout name `gpu-<family>-int<bits>` in manifest.json. Every family shares one quantization (ktlayouts.gptq:
symmetric codes (K, N) with zero point 2^(bits-1), scales (n_groups, N), g_idx (K,)) and differs in byte order;
the byte-level codecs are gptq.py, marlin.py and compressed_tensors.py. A registered format object knows

  name, family, bits     'gpu-marlin-int4', 'marlin', 4
  parts                  suffixes and safetensors dtypes; part_shapes(geometry) gives their shapes
  storage_geometry       the GptqGeometry a logical (N, K) is stored in (Marlin zero-pads to its tiles)
  pack / unpack          codes (K, N), scales (n_groups, N), g_idx, logical shape <-> {suffix: array}
  dequantize             {suffix: array} -> W (N, K) float32, geometry derived from the stored shapes alone
  quantization_config    config.json's `quantization_config` for the engines that read the family (None: ours only)

This module is the only place layout names are built (`layout_name`) or parsed (`gpu_format`). Used by the
converter (ktconvert.gpu.encoder), `ktconvert verify` / `export`, and ktrun (dequantized on the CPU when there is
no GPU, or kept packed for a Marlin kernel). Adding a format: one subclass of GpuLinearFormat under @register.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import compressed_tensors as ct
from . import gptq, marlin
from .cpu_expert import LayoutError
from .gptq import GPU_BITS, GptqGeometry, check_bits, dequantize_kn, group_size_for

LAYOUT_PREFIX = "gpu-"


@dataclass(frozen=True)
class Part:
    """One stored tensor of a quantized Linear: `X.<suffix>`."""
    suffix: str
    dtype: str              # safetensors dtype as written by the converter
    required: bool = True   # False: a reader supplies the default when absent (g_idx = k // G)


@dataclass(frozen=True)
class UnpackedLinear:
    """The common form of every GPU format (stored, i.e. padded, sizes; `shape` is the logical (N, K))."""
    codes_kn: np.ndarray    # (K_stored, N_stored) uint8, zero point 2^(bits-1)
    scales_gn: np.ndarray   # (n_groups, N_stored) float16 (float32 where stored so)
    g_idx: np.ndarray       # (K_stored,) int32
    geom: GptqGeometry      # stored geometry
    shape: tuple[int, int]  # logical (N, K) <= (geom.n, geom.k)


def _logical_shape(parts: dict, geom: GptqGeometry, what: str) -> tuple[int, int]:
    shape = parts.get("weight_shape")
    if shape is None:
        return geom.n, geom.k
    n, k = (int(x) for x in np.asarray(shape).reshape(-1))
    if not (0 < n <= geom.n and 0 < k <= geom.k):
        raise LayoutError(f"{what}: weight_shape {[n, k]} exceeds the stored {[geom.n, geom.k]}")
    return n, k


class GpuLinearFormat:
    """One registered GPU Linear layout (a family at one bit width). Subclasses set the class attributes and
    implement part_shapes, stored_geometry, _pack and _unpack; the rest is shared."""

    family: ClassVar[str]                  # --gpu-format value, middle of the layout name
    title: ClassVar[str]                   # for messages: "Marlin"
    parts: ClassVar[tuple[Part, ...]]      # parts[0] marks a Linear of this format in a file
    scale_part: ClassVar[str]              # the suffix of the part holding the scales
    pads: ClassVar[bool] = False           # zero-pads shapes it cannot tile (readers crop to weight_shape)
    stores_g_idx: ClassVar[bool] = False   # keeps a permuted g_idx (act-order GPTQ with grouped scales)
    kernel: ClassVar[str | None] = None    # the device GEMM that reads the packed parts in place
    quant_method: ClassVar[str | None] = None   # config.json quantization_config quant_method; None: ktrun only

    def __init__(self, bits: int):
        check_bits(bits)
        self.bits = bits

    def __repr__(self) -> str:
        return f"<GPU format {self.name}>"

    @property
    def name(self) -> str:
        return layout_name(self.family, self.bits)

    @property
    def suffixes(self) -> tuple[str, ...]:
        return tuple(p.suffix for p in self.parts)

    @property
    def primary(self) -> str:
        return self.parts[0].suffix

    # --- geometry -------------------------------------------------------------------------------------------
    def storage_geometry(self, n: int, k: int, group_size: int) -> GptqGeometry:
        """Geometry of a logical (N, K) Linear as stored (LayoutError when the format cannot store it)."""
        return GptqGeometry(n, k, self.bits, group_size)

    def part_shapes(self, geom: GptqGeometry) -> list[tuple[str, str, tuple[int, ...]]]:
        """[(suffix, safetensors dtype, shape)] of the parts, in `parts` order."""
        raise NotImplementedError

    def stored_geometry(self, parts: dict[str, np.ndarray], what: str = "weight") -> tuple[GptqGeometry, tuple]:
        """(stored GptqGeometry, logical (N, K)) from the parts' shapes alone (nothing is unpacked)."""
        raise NotImplementedError

    # --- pack / unpack --------------------------------------------------------------------------------------
    def pack(self, codes_kn: np.ndarray, scales_gn: np.ndarray, geom: GptqGeometry, g_idx: np.ndarray | None = None,
             shape: tuple[int, int] | None = None, name: str = "weight", scale_dtype=np.float16
             ) -> dict[str, np.ndarray]:
        """codes (K, N) uint8, scales (n_groups, N), stored geometry, g_idx (K,) (None: k // G), logical (N, K)
        (None: the geometry's) -> {suffix: array}. scale_dtype float32 keeps scales exact (experts' export)."""
        if geom.bits != self.bits:
            raise LayoutError(f"{name}: {geom.bits}-bit codes cannot be stored as {self.name}")
        if g_idx is not None and not self.stores_g_idx and not np.array_equal(g_idx, geom.default_g_idx()):
            raise LayoutError(f"{name}: {self.name} has no g_idx; a permuted group order (act order with grouped "
                              "scales) needs a format that stores one")
        shape = (geom.n, geom.k) if shape is None else tuple(int(x) for x in shape)
        if not (0 < shape[0] <= geom.n and 0 < shape[1] <= geom.k) or (not self.pads and shape != (geom.n, geom.k)):
            raise LayoutError(f"{name}: logical shape {list(shape)} does not fit the stored {[geom.n, geom.k]} "
                              f"of {self.name}")
        return self._pack(codes_kn, scales_gn, geom, g_idx, shape, name, np.dtype(scale_dtype))

    def unpack(self, parts: dict[str, np.ndarray], what: str = "weight") -> UnpackedLinear:
        """{suffix: array} -> codes (K, N), scales (n_groups, N), g_idx, stored geometry and logical (N, K)."""
        missing = [p.suffix for p in self.parts if p.required and p.suffix not in parts]
        if missing:
            raise LayoutError(f"{what}: {self.name} needs tensors {missing}")
        geom, shape = self.stored_geometry(parts, what)
        codes, scales, g_idx = self._unpack(parts, geom)
        return UnpackedLinear(codes, scales, g_idx, geom, shape)

    def dequantize(self, parts: dict[str, np.ndarray], what: str = "weight") -> np.ndarray:
        """{suffix: array} -> W (N, K) float32 (padding removed)."""
        u = self.unpack(parts, what)
        w = dequantize_kn(u.codes_kn, u.scales_gn, u.g_idx, self.bits)
        n, k = u.shape
        return w if (n, k) == w.shape else np.ascontiguousarray(w[:n, :k])

    def _pack(self, codes_kn, scales_gn, geom, g_idx, shape, name, scale_dtype) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _unpack(self, parts, geom) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError

    # --- config.json ----------------------------------------------------------------------------------------
    def quantization_config(self, group_size: int, act_order: bool = False, quantize_head: bool = False,
                            percdamp: float = 0.01) -> dict | None:
        """config.json `quantization_config` of a checkpoint whose Linears are in this format (None: no engine
        but ktrun reads it, so there is none)."""
        return None

    def with_unquantized(self, qc: dict, modules: list[str] = (), regexes: list[str] = ()) -> dict:
        """A copy of `qc` marking modules (exact names) and modules matching `regexes` (re.match) as not quantized."""
        raise LayoutError(f"{self.name} has no quantization_config")

    def with_scheme(self, qc: dict, regex: str, bits: int, group_size: int) -> dict:
        """A copy of `qc` with a second scheme (bits, group size; -1 per output channel) for modules matching
        `regex`, outranking the first one."""
        raise LayoutError(f"{self.name} has no quantization_config")

    def module_pattern(self, regex: str, quantized: bool) -> str:
        """How this family's quantization_config spells `regex` as a module pattern (quantized or excluded)."""
        raise LayoutError(f"{self.name} has no quantization_config")


def _copy(qc: dict) -> dict:
    import json
    return json.loads(json.dumps(qc))


# --- the registry ------------------------------------------------------------------------------------------------

_FORMATS: dict[str, GpuLinearFormat] = {}      # layout name -> format, in registration order
_FAMILIES: dict[str, type[GpuLinearFormat]] = {}


def register(cls: type[GpuLinearFormat]) -> type[GpuLinearFormat]:
    """Class decorator: register a family at every GPU bit width (GPU_BITS)."""
    if cls.family in _FAMILIES:
        raise ValueError(f"GPU format family {cls.family!r} registered twice")
    _FAMILIES[cls.family] = cls
    for bits in GPU_BITS:
        fmt = cls(bits)
        _FORMATS[fmt.name] = fmt
    return cls


def layout_name(family: str, bits: int) -> str:
    """('marlin', 4) -> 'gpu-marlin-int4' (the only place a GPU layout name is built)."""
    return f"{LAYOUT_PREFIX}{family}-int{bits}"


def gpu_format(layout: str) -> GpuLinearFormat:
    """'gpu-marlin-int4' -> its format object; LayoutError naming the layout otherwise."""
    fmt = _FORMATS.get(layout)
    if fmt is None:
        raise LayoutError(f"{layout!r} is not a GPU-layer layout; known: {', '.join(_FORMATS)}")
    return fmt


def gpu_format_for(family: str, bits: int) -> GpuLinearFormat:
    """('gptq', 8) -> the format object; LayoutError naming the family or bits otherwise."""
    if family not in _FAMILIES:
        raise LayoutError(f"GPU format {family!r}: choose one of {', '.join(_FAMILIES)}")
    check_bits(bits)
    return _FORMATS[layout_name(family, bits)]


def is_gpu_layout(layout: str) -> bool:
    return layout in _FORMATS


def gpu_layouts() -> tuple[str, ...]:
    return tuple(_FORMATS)


def format_families() -> tuple[str, ...]:
    """The --gpu-format choices, in registration order."""
    return tuple(_FAMILIES)


def families_where(attr: str) -> tuple[str, ...]:
    """Families whose class attribute `attr` is truthy (e.g. 'pads', 'stores_g_idx', 'quant_method')."""
    return tuple(f for f, cls in _FAMILIES.items() if getattr(cls, attr))


# --- the formats ---------------------------------------------------------------------------------------------------

@register
class MarlinFormat(GpuLinearFormat):
    """ktlayouts.marlin: the Marlin W4A16/W8A16 GEMM's tiles, zero-padded to N % 64, K % 128; ktrun only."""
    family, title = "marlin", "Marlin"
    scale_part = "scales"
    parts = (Part("qweight", "I32"), Part("scales", "F16"), Part("weight_shape", "I64"))
    pads = True
    kernel = "marlin"

    def storage_geometry(self, n, k, group_size):
        n_pad, k_pad = marlin.marlin_padded_shape(n, k, group_size)
        return GptqGeometry(n_pad, k_pad, self.bits, group_size)

    def part_shapes(self, geom):
        return [("qweight", "I32", (geom.k // marlin.MARLIN_TILE, geom.n * marlin.MARLIN_TILE * geom.bits // 32)),
                ("scales", "F16", geom.scales_shape), ("weight_shape", "I64", (2,))]

    def stored_geometry(self, parts, what="weight"):
        k, n = marlin.qweight_kn(parts["qweight"].shape, self.bits)
        scales = parts["scales"]
        if scales.ndim != 2 or scales.shape[1] != n:
            raise LayoutError(f"{what}: scales {list(scales.shape)} do not fit qweight {list(parts['qweight'].shape)} "
                              f"(N={n})")
        geom = GptqGeometry(n, k, self.bits, group_size_for(k, scales.shape[0], what))
        return geom, _logical_shape(parts, geom, what)

    def _pack(self, codes_kn, scales_gn, geom, g_idx, shape, name, scale_dtype):
        if scale_dtype != np.float16:
            raise LayoutError(f"{name}: {self.name} stores float16 scales, not {scale_dtype}")
        t = marlin.marlin_pack(codes_kn, scales_gn, geom, name=name)
        return {"qweight": t["qweight"], "scales": t["scales"], "weight_shape": np.array(shape, dtype=np.int64)}

    def _unpack(self, parts, geom):
        codes, scales = marlin.marlin_unpack(parts, geom)
        return codes, scales, geom.default_g_idx()


@register
class GptqFormat(GpuLinearFormat):
    """ktlayouts.gptq: AutoGPTQ / GPTQModel checkpoints (v1 zero points), read by vLLM and transformers."""
    family, title = "gptq", "GPTQ"
    scale_part = "scales"
    parts = (Part("qweight", "I32"), Part("qzeros", "I32"), Part("scales", "F16"), Part("g_idx", "I32", False))
    stores_g_idx = True
    quant_method = "gptq"

    def part_shapes(self, geom):
        return [("qweight", "I32", geom.qweight_shape), ("qzeros", "I32", geom.qzeros_shape),
                ("scales", "F16", geom.scales_shape), ("g_idx", "I32", (geom.k,))]

    def stored_geometry(self, parts, what="weight"):
        qw = parts["qweight"]
        k, n = qw.shape[0] * 32 // self.bits, qw.shape[1]
        geom = GptqGeometry(n, k, self.bits, group_size_for(k, parts["scales"].shape[0], what))
        return geom, (n, k)

    def _pack(self, codes_kn, scales_gn, geom, g_idx, shape, name, scale_dtype):
        return gptq.gptq_pack(codes_kn, scales_gn, geom, g_idx, scale_dtype=scale_dtype)

    def _unpack(self, parts, geom):
        return gptq.gptq_unpack(parts, geom)

    def quantization_config(self, group_size, act_order=False, quantize_head=False, percdamp=0.01):
        return {"quant_method": "gptq", "bits": self.bits, "group_size": group_size, "desc_act": act_order,
                "sym": True, "damp_percent": percdamp, "true_sequential": False, "static_groups": False,
                "checkpoint_format": "gptq", "lm_head": quantize_head}

    def module_pattern(self, regex, quantized):
        # GPTQModel / vLLM `dynamic`: "+:regex" overrides a module's scheme, "-:regex" leaves it unquantized
        return ("+:" if quantized else "-:") + regex

    def with_unquantized(self, qc, modules=(), regexes=()):
        qc = _copy(qc)
        dynamic = dict(qc.get("dynamic") or {})
        for r in regexes:
            dynamic.setdefault(self.module_pattern(r, quantized=False), {})
        for name in modules:
            if name != "lm_head":                  # lm_head follows the config's own `lm_head` flag
                dynamic.setdefault(self.module_pattern(name.replace(".", r"\.") + "$", quantized=False), {})
        qc["dynamic"] = dynamic
        return qc

    def with_scheme(self, qc, regex, bits, group_size):
        qc = _copy(qc)
        dynamic = dict(qc.get("dynamic") or {})
        dynamic[self.module_pattern(regex, quantized=True)] = {"bits": bits, "group_size": group_size}
        qc["dynamic"] = dynamic
        return qc


@register
class CompressedTensorsFormat(GpuLinearFormat):
    """ktlayouts.compressed_tensors: llm-compressor's pack-quantized, read by vLLM and transformers."""
    family, title = "compressed-tensors", "compressed-tensors"
    scale_part = "weight_scale"
    parts = (Part("weight_packed", "I32"), Part("weight_scale", "F16"), Part("weight_shape", "I64"))
    quant_method = "compressed-tensors"

    def part_shapes(self, geom):
        return [("weight_packed", "I32", (geom.n, geom.k * geom.bits // 32)),
                ("weight_scale", "F16", geom.scales_shape[::-1]), ("weight_shape", "I64", (2,))]

    def stored_geometry(self, parts, what="weight"):
        wp = parts["weight_packed"]
        n, k = wp.shape[0], wp.shape[1] * 32 // self.bits
        geom = GptqGeometry(n, k, self.bits, group_size_for(k, parts["weight_scale"].shape[1], what))
        return geom, _logical_shape(parts, geom, what)

    def _pack(self, codes_kn, scales_gn, geom, g_idx, shape, name, scale_dtype):
        return ct.ct_pack(codes_kn, scales_gn, geom, scale_dtype=scale_dtype)

    def _unpack(self, parts, geom):
        codes, scales = ct.ct_unpack(parts, geom)
        return codes, scales, geom.default_g_idx()

    @staticmethod
    def _weights(bits: int, group_size: int) -> dict:
        return {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False, "observer": "minmax",
                "strategy": "channel" if group_size == -1 else "group",
                "group_size": None if group_size == -1 else group_size, "actorder": None, "block_structure": None}

    def quantization_config(self, group_size, act_order=False, quantize_head=False, percdamp=0.01):
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": self._weights(self.bits, group_size),
                                              "input_activations": None, "output_activations": None,
                                              "format": "pack-quantized"}},
                "ignore": [] if quantize_head else ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}

    def module_pattern(self, regex, quantized):
        return "re:" + regex                       # `targets` and `ignore` entries alike (re.match)

    def with_unquantized(self, qc, modules=(), regexes=()):
        qc = _copy(qc)
        ignore = list(qc.get("ignore") or [])
        for entry in [self.module_pattern(r, quantized=False) for r in regexes] + list(modules):
            if entry not in ignore:
                ignore.append(entry)
        qc["ignore"] = ignore
        return qc

    def with_scheme(self, qc, regex, bits, group_size):
        # a regex target outranks the class target "Linear" in compressed-tensors, vLLM and transformers alike
        qc = _copy(qc)
        first = next(iter(qc["config_groups"].values()))
        weights = dict(first["weights"], num_bits=bits, type="int", symmetric=True, dynamic=False, actorder=None,
                       strategy="channel" if group_size == -1 else "group",
                       group_size=None if group_size == -1 else group_size)
        qc["config_groups"][f"group_{len(qc['config_groups'])}"] = {
            "targets": [self.module_pattern(regex, quantized=True)], "weights": weights, "input_activations": None,
            "output_activations": None, "format": "pack-quantized"}
        return qc


# --- whole files -------------------------------------------------------------------------------------------------

def dequantize_linear(layout: str, parts: dict[str, np.ndarray], what: str = "weight") -> np.ndarray:
    """parts: {suffix: array} of one Linear (e.g. {'qweight':..., 'scales':..., 'weight_shape':...}) -> W (N, K) f32."""
    return gpu_format(layout).dequantize(parts, what)


def linear_parts(layout: str, tensors: dict, weight_name: str) -> dict:
    """The parts {suffix: tensor} of Linear `weight_name` ('X.weight') among a file's tensors (by full name)."""
    base = weight_name.removesuffix(".weight")
    return {p: tensors[f"{base}.{p}"] for p in gpu_format(layout).suffixes if f"{base}.{p}" in tensors}


def dequantize_named(layout: str, tensors: dict[str, np.ndarray], weight_name: str) -> np.ndarray:
    """tensors of a converted file (by full name), the hub weight name 'X.weight' -> W (N, K) float32."""
    return dequantize_linear(layout, linear_parts(layout, tensors, weight_name), what=weight_name)


def quantized_linears(names, layouts: dict[str, str]) -> dict[str, str]:
    """Output tensor names + their layouts -> {hub weight name 'X.weight': layout} of the quantized Linears."""
    out = {}
    for name in names:
        fmt = _FORMATS.get(layouts.get(name, ""))
        if fmt is not None:
            base, _, part = name.rpartition(".")
            if part == fmt.primary:
                out[f"{base}.weight"] = fmt.name
    return out


# Limits on ||W_hat - W|| / ||W|| that `verify --against` applies to GPU-layer weights. INT4 GPTQ trades weight
# error for output error (measured 0.10-0.20 on the fixtures); a wrong layout or scale gives ~1 or more.
GPU_MAX_REL_ERROR = {4: 0.35, 8: 0.05}


def max_rel_error(layout: str) -> float:
    return GPU_MAX_REL_ERROR[gpu_format(layout).bits]
