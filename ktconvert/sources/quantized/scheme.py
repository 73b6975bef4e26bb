"""What every already-quantized checkpoint format shares: stored parts grouped into logical Linear weights.

A quantized Linear `X` is stored as several tensors `X.<part>` (compressed-tensors: weight_packed, weight_scale,
weight_shape; GPTQ/AWQ: qweight, qzeros, scales, g_idx; FP8: weight + weight_scale). The reader presents it as one
logical tensor `X.weight` of the Linear's (N, K) shape, so roles, planning and the pipeline see hub names as
for any other checkpoint. Its `QuantTensorInfo` keeps the parts (for reading) and the format (for the log, inspect
and the exact paths); its nbytes are the stored bytes of all parts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.sources.quantized.grid import IntGrid
from ktconvert.sources.roles import SourceError


@dataclass(frozen=True)
class WeightFormat:
    """How one logical weight is stored."""
    family: str            # compressed-tensors | gptq | awq | fp8
    kind: str              # int | fp8 | mxfp4 | mxfp8 | nvfp4
    bits: int
    group: int             # input channels per scale; -1 one per output channel, 0 one per tensor, -2 blocks
    symmetric: bool = True
    act_order: bool = False    # a g_idx that may permute the groups
    name: str = ""             # a fixed label (GGUF types), else built from the fields

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        grain = {0: "per tensor", -1: "per channel", -2: "blocks"}.get(self.group, f"g{self.group}")
        if self.kind != "int":
            return f"{self.family} {self.kind} {grain}" if self.kind == "fp8" else f"{self.family} {self.kind}"
        return (f"{self.family} int{self.bits} {grain}" + ("" if self.symmetric else " asym")
                + (" act-order" if self.act_order else ""))


@dataclass(frozen=True)
class QuantTensorInfo:
    """A logical weight X.weight (N, K) made of stored parts; file/offset are those of its first stored part."""
    name: str
    dtype: str             # the format's label (what inspect shows)
    shape: tuple
    file: Path
    offset: int
    nbytes: int            # stored bytes of all parts
    parts: dict = field(hash=False, compare=False)      # part suffix -> st_header.TensorInfo
    fmt: WeightFormat | None = None

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


class QuantScheme:
    """One checkpoint's quantization_config bound to its tensors. Subclasses set `family` and `markers` (part
    suffixes whose presence marks a quantized Linear), and implement `describe` and `decode`."""

    family: str = ""
    parts: tuple[str, ...] = ()        # every suffix a quantized Linear may store
    markers: tuple[str, ...] = ()      # suffixes that mark a module as quantized

    def __init__(self, qc: dict, where: str):
        self.qc, self.where = qc, where

    def field(self, key: str) -> str:
        return f"{self.where}: quantization_config.{key}"

    # --- the logical table -------------------------------------------------------------------------------------
    def logical_tensors(self, infos: dict, names: list[str], read) -> tuple[dict, list[str]]:
        """Stored tensor table -> logical table: every quantized Linear's parts replaced by one QuantTensorInfo
        named X.weight, at the position of its first part; other tensors unchanged."""
        by_module: dict[str, dict] = {}
        for name in names:
            base, _, suffix = name.rpartition(".")
            if suffix in self.parts:
                by_module.setdefault(base, {})[suffix] = infos[name]
        quantized = {b: p for b, p in by_module.items() if any(m in p for m in self.markers)}
        out_infos, out_names, seen = {}, [], set()
        for name in names:
            base, _, suffix = name.rpartition(".")
            if base in quantized and suffix in self.parts:
                if base not in seen:
                    seen.add(base)
                    q = self.describe(base, quantized[base], read)
                    out_infos[q.name] = q
                    out_names.append(q.name)
                continue
            out_infos[name] = infos[name]
            out_names.append(name)
        return out_infos, out_names

    def make_info(self, module: str, parts: dict, shape: tuple, fmt: WeightFormat) -> QuantTensorInfo:
        first = min(parts.values(), key=lambda i: (str(i.file), i.offset))
        return QuantTensorInfo(f"{module}.weight", fmt.label, tuple(int(x) for x in shape), first.file, first.offset,
                               sum(i.nbytes for i in parts.values()), dict(parts), fmt)

    def describe(self, module: str, parts: dict, read) -> QuantTensorInfo:
        """Validate one quantized Linear's parts against the config (shapes and dtypes; read(part) for the few
        formats that store the logical shape as data)."""
        raise NotImplementedError

    def decode(self, info: QuantTensorInfo, read) -> IntGrid | np.ndarray:
        """The weight's values: an IntGrid for integer grids, else float32 (N, K). read(part TensorInfo) ->
        the stored array (its own dtype; BF16 as float32, F8_E4M3 as uint8 bits)."""
        raise NotImplementedError

    # --- helpers -------------------------------------------------------------------------------------------------
    @staticmethod
    def need(parts: dict, module: str, suffix: str, why: str = ""):
        if suffix not in parts:
            raise SourceError(f"tensor {module}.{suffix} is missing{': ' + why if why else ''} "
                              f"(found {', '.join(sorted(parts))})")
        return parts[suffix]

    @staticmethod
    def check(info, dtypes: tuple[str, ...], shape: tuple | None, why: str) -> None:
        """A part's dtype and shape, or SourceError naming the file, tensor and what was expected."""
        if info.dtype not in dtypes or (shape is not None and tuple(info.shape) != tuple(shape)):
            want = f"{'/'.join(dtypes)}{list(shape) if shape is not None else ''}"
            raise SourceError(f"{info.file}: tensor {info.name}: {info.dtype}{list(info.shape)}, expected {want} "
                              f"({why})")


def scale_values(a: np.ndarray, info, what: str) -> np.ndarray:
    """Scales as float32, refusing non-finite or negative-zero-free garbage: NaN/Inf name the tensor."""
    s = np.asarray(a, dtype=np.float32)
    bad = ~np.isfinite(s)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SourceError(f"{info.file}: tensor {info.name}: non-finite {what} at element "
                          f"{tuple(int(x) for x in np.unravel_index(i, s.shape))}")
    return s
